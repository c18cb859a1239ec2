"""A step's rows by adapter, and the updates an adapted layer adds to them.

The runner tells the step which rows belong to which request's adapter before the model runs; each adapted
projection then adds, for each adapter in the step, (x @ A.T @ B.T) * scaling to that adapter's rows and
columns (a segmented matmul: one per adapter and module, over its rows only). The base's rows and another
adapter's are never written, so an adapter never changes another row's bits. As peft applies an adapter
(its `autocast_adapter_dtype`, the default), the update is added to the base output in float32, then rounded
to the model's dtype; it is computed in float64, so that its sums round alike whatever rows share the matmul
(float32 sums did not on AVX2: bf16 cache on and off differed there).

The last layer runs its attention output and MLP for the sampled rows only (llama.py: output_rows); a
layer's input of that many rows reads the step's rows in that order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from .adapter import LoRAAdapter


class Batched(NamedTuple):
    """Several adapters' rows of one step laid out for one batched matmul pair: `gather` picks each adapter's
    rows of x into [adapters, rows, in] (a short group repeats its last row), `valid` keeps the real ones of the
    result, in `rows` order."""

    adapters: tuple[LoRAAdapter, ...]
    per_group: int
    gather: torch.Tensor
    valid: Optional[torch.Tensor]  # None: no group was short
    rows: torch.Tensor


class LoRAStep:
    def __init__(self) -> None:
        self.num_rows = 0
        self.groups: list[tuple[LoRAAdapter, torch.Tensor]] = []  # (adapter, its rows of the step)
        self.kept_groups: list[tuple[LoRAAdapter, torch.Tensor]] = []  # the same within the kept rows
        self.batched: Optional[Batched] = None  # the groups as one batch, when there are several
        self.kept_batched: Optional[Batched] = None
        # (adapters' fingerprints, layer, module) -> the stacked A, B and scalings; only the latest adapter set
        # is kept (a steady batch keeps its set for many steps)
        self._stacks: dict[tuple, Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._stacked_for: tuple = ()

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
        grouped = list(rows.values())
        self.groups = [(adapter, torch.tensor(r, dtype=torch.int64, device=device)) for adapter, r in grouped]
        self.batched = _batch(grouped, device)
        if kept_rows is None:
            self.kept_groups, self.kept_batched = self.groups, self.batched
            return
        position = {row: index for index, row in enumerate(kept_rows)}
        kept_grouped = []
        for adapter, adapter_rows in grouped:
            kept = [position[row] for row in adapter_rows if row in position]
            if kept:
                kept_grouped.append((adapter, kept))
        self.kept_groups = [(adapter, torch.tensor(r, dtype=torch.int64, device=device)) for adapter, r in kept_grouped]
        self.kept_batched = _batch(kept_grouped, device)

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += this step's adapters' updates of `module` in `layer`, on their rows of x (the module's input)."""
        full = x.shape[0] == self.num_rows
        batched = self.batched if full else self.kept_batched
        if batched is not None:
            self._apply_batched(batched, layer, module, x, out)
            return
        for adapter, rows in self.groups if full else self.kept_groups:
            update = adapter.layers[layer].get(module)
            if update is not None:
                delta = F.linear(F.linear(x.index_select(0, rows).double(), update.a), update.b).mul_(update.scaling)
                _add(out, rows, delta)

    def _apply_batched(self, batched: Batched, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        stacks = self._stack(batched.adapters, layer, module)
        if stacks is None:
            return
        a, b, scalings = stacks
        inputs = x.index_select(0, batched.gather).double().view(len(batched.adapters), batched.per_group, -1)
        delta = torch.bmm(torch.bmm(inputs, a.transpose(1, 2)), b.transpose(1, 2)).mul_(scalings)
        delta = delta.view(-1, delta.shape[-1])
        if batched.valid is not None:
            delta = delta.index_select(0, batched.valid)
        _add(out, batched.rows, delta)

    def _stack(self, adapters: tuple[LoRAAdapter, ...], layer: int, module: str):
        """The adapters' updates of one projection stacked: A [G, R, in], B [G, out, R] (zero-padded to the
        highest rank: a zero adds exactly nothing) and scalings [G, 1, 1]; None when none adapts it."""
        key = tuple(adapter.fingerprint for adapter in adapters)
        if key != self._stacked_for:
            self._stacks, self._stacked_for = {}, key
        if (layer, module) not in self._stacks:
            updates = [adapter.layers[layer].get(module) for adapter in adapters]
            present = [update for update in updates if update is not None]
            if not present:
                self._stacks[layer, module] = None
            else:
                rank = max(update.a.shape[0] for update in present)
                width, in_features = present[0].b.shape[0], present[0].a.shape[1]
                options = {"device": present[0].a.device, "dtype": present[0].a.dtype}
                a = torch.zeros(len(adapters), rank, in_features, **options)
                b = torch.zeros(len(adapters), width, rank, **options)
                scalings = torch.zeros(len(adapters), 1, 1, **options)
                for index, update in enumerate(updates):
                    if update is not None:
                        a[index, : update.a.shape[0]] = update.a
                        b[index, :, : update.a.shape[0]] = update.b
                        scalings[index] = update.scaling
                self._stacks[layer, module] = (a, b, scalings)
        return self._stacks[layer, module]


def _batch(grouped: list[tuple[LoRAAdapter, list[int]]], device: torch.device) -> Optional[Batched]:
    """Several adapters' rows as one batch (None for fewer than two adapters: their own matmuls cost less)."""
    if len(grouped) < 2:
        return None
    per_group = max(len(rows) for _, rows in grouped)
    gather, valid, ordered = [], [], []
    for index, (_, rows) in enumerate(grouped):
        gather += rows + [rows[-1]] * (per_group - len(rows))
        valid += range(index * per_group, index * per_group + len(rows))
        ordered += rows
    short = len(valid) != len(gather)
    return Batched(
        tuple(adapter for adapter, _ in grouped),
        per_group,
        torch.tensor(gather, dtype=torch.int64, device=device),
        torch.tensor(valid, dtype=torch.int64, device=device) if short else None,
        torch.tensor(ordered, dtype=torch.int64, device=device),
    )


def _add(out: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """out[rows] += delta, as peft adds its float32 update to the base's output: the update, computed in float64
    (its sums then round alike whatever rows share the matmul, where float32 sums may not: batch invariance),
    is rounded to float32 and added in float32, then rounded once to out's dtype."""
    delta = delta.float()
    if out.dtype == torch.float32:
        out.index_add_(0, rows, delta)
    else:
        out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta).to(out.dtype))


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
