"""A step's rows by adapter, and the updates an adapted layer adds to them.

The runner tells the step which rows belong to which request's adapter before the model runs; each adapted
projection then adds, for each adapter in the step, (x @ A.T @ B.T) * scaling to that adapter's rows and
columns (a segmented matmul: one per adapter and module, over its rows only). The base's rows and another
adapter's are never written, so an adapter never changes another row's bits. As peft applies an adapter
(its `autocast_adapter_dtype`, the default), the update is computed in float32 and added to the base
output in float32, then rounded to the model's dtype.

The last layer runs its attention output and MLP for the sampled rows only (llama.py: output_rows); a
layer's input of that many rows reads the step's rows in that order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .adapter import LoRAAdapter


class LoRAStep:
    def __init__(self) -> None:
        self.num_rows = 0
        self.groups: list[tuple[LoRAAdapter, torch.Tensor]] = []  # (adapter, its rows of the step)
        self.kept_groups: list[tuple[LoRAAdapter, torch.Tensor]] = []  # the same within the kept rows

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def begin(
        self,
        segments: Sequence[tuple[Optional[LoRAAdapter], int, int]],
        num_rows: int,
        kept_rows: Optional[Sequence[int]],
        device: torch.device,
    ) -> None:
        """This step's (adapter or None, first row, end row) per request; `kept_rows`: the rows the last layer
        keeps (None: all)."""
        rows: dict[str, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, start, end in segments:
            if adapter is not None:
                rows.setdefault(adapter.fingerprint, (adapter, []))[1].extend(range(start, end))
        self.num_rows = num_rows
        self.groups = [(adapter, torch.tensor(r, dtype=torch.int64, device=device)) for adapter, r in rows.values()]
        if kept_rows is None:
            self.kept_groups = self.groups
            return
        position = {row: index for index, row in enumerate(kept_rows)}
        self.kept_groups = []
        for adapter, adapter_rows in rows.values():
            kept = [position[row] for row in adapter_rows if row in position]
            if kept:
                self.kept_groups.append((adapter, torch.tensor(kept, dtype=torch.int64, device=device)))

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += this step's adapters' updates of `module` in `layer`, on their rows of x (the module's input)."""
        groups = self.groups if x.shape[0] == self.num_rows else self.kept_groups
        for adapter, rows in groups:
            pieces = adapter.layers[layer].get(module)
            if not pieces:
                continue
            inputs = x.index_select(0, rows).float()
            for piece in pieces:
                delta = F.linear(F.linear(inputs, piece.a), piece.b) * piece.scaling
                columns = out[:, piece.start : piece.start + piece.size]
                updated = (columns.index_select(0, rows).float() + delta).to(out.dtype)
                columns.index_copy_(0, rows, updated)


class LayerLoRA:
    """What one decoder layer's attention or MLP calls after each projection: its layer's updates of this step."""

    def __init__(self, step: LoRAStep, layer: int) -> None:
        self.step = step
        self.layer = layer

    def apply(self, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.step.groups:
            self.step.apply(self.layer, module, x, out)


def attach(model, step: LoRAStep) -> None:
    """Give every layer of `model` (llama.py's) the step's updates, and keep its compiled decoder stack (which
    knows no adapters) out of the steps that have any."""
    for index, layer in enumerate(model.layers):
        layer.self_attn.lora = LayerLoRA(step, index)
        layer.mlp.lora = LayerLoRA(step, index)
    model.lora_step = step
