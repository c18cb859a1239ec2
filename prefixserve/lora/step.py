"""A step's rows by adapter, and the updates an adapted layer adds to them.

The runner tells the step which rows belong to which request's adapter before the model runs; each adapted
projection then adds, for each row with an adapter, (x @ A.T @ B.T) * scaling to that row (a segmented matmul:
each row by its own adapter). The base's rows and another adapter's are never written, so an adapter never
changes another row's bits. As peft applies an adapter (its `autocast_adapter_dtype`, the default), the update
is computed and added to the base output in float32, then rounded to the model's dtype.

Two ways, one answer per row whatever shares the step:
- the compiled kernel (csrc/lora.cpp through csrc/lora_slots.cpp), on CPU tensors: each step's adapters are
  installed once in one of `max_loras` slots, and each adapted projection is one call that updates every row
  by its slot's adapter, each row's sums in an order fixed by the row alone;
- PyTorch's (any device, or where no kernel was built): each adapter's rows gathered and multiplied in one
  batched matmul, computed in float64 so that its sums round alike whatever rows share the matmul (float32
  sums did not on AVX2: bf16 cache on and off differed there), then added in float32.

The last layer runs its attention output and MLP for the sampled rows only (llama.py: output_rows); a
layer's input of that many rows reads the step's rows in that order.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .adapter import FusedUpdate, LoRAAdapter

MODULES = ("qkv", "o", "gate_up", "down")  # lora_slots.cpp's module order
_MODULE_INDEX = {name: index for index, name in enumerate(MODULES)}


class KernelSlots:
    """The compiled kernel's adapter slots (csrc/lora_slots.cpp) and which adapter each holds: a step's
    adapters are installed where they are not yet, in free slots or those used longest ago."""

    def __init__(self, table, num_slots: int) -> None:
        self.table = table  # prefixserve._C.LoRASlots
        self.held: list[Optional[str]] = [None] * num_slots  # each slot's adapter fingerprint
        self.last_used = [0] * num_slots
        self.clock = 0

    def slots_of(self, adapters: Sequence[LoRAAdapter]) -> Optional[dict[str, int]]:
        """fingerprint -> slot for a step's adapters, installing those not held; None when they outnumber the
        slots (the step runs PyTorch's way)."""
        if len(adapters) > len(self.held):
            return None
        self.clock += 1
        wanted = {adapter.fingerprint for adapter in adapters}
        slots = {fingerprint: slot for slot, fingerprint in enumerate(self.held) if fingerprint in wanted}
        spare = [slot for slot, held in enumerate(self.held) if held not in wanted]
        spare.sort(key=self.last_used.__getitem__)
        for adapter in adapters:
            if adapter.fingerprint not in slots:
                slot = spare.pop(0)
                self.table.install(slot, [kernel_layout(layer) for layer in adapter.layers])
                self.held[slot] = adapter.fingerprint
                slots[adapter.fingerprint] = slot
        for slot in slots.values():
            self.last_used[slot] = self.clock
        return slots


def kernel_layout(layer: dict[str, FusedUpdate]) -> tuple:
    """One layer's updates as lora_slots.cpp installs them: per module None or (A.T zero-padded to a multiple of
    16 columns, scaling, output columns, [(the part's B.T, its first rank, its first column) per part])."""
    laid_out = []
    for module in MODULES:
        update = layer.get(module)
        if update is None:
            laid_out.append(None)
            continue
        rank, in_features = update.a.shape
        a_t = torch.zeros(in_features, -(-rank // 16) * 16, dtype=torch.float32)
        a_t[:, :rank] = update.a.t()
        parts = [
            (update.b[column : column + width, first : first + part_rank].t().contiguous(), first, column)
            for first, part_rank, column, width in update.parts
        ]
        laid_out.append((a_t, update.scaling, update.b.shape[0], parts))
    return tuple(laid_out)


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
    def __init__(self, max_loras: int = 1, kernel_slots: Optional[Callable[[int, int], object]] = None) -> None:
        """`kernel_slots(num_slots, num_layers)`: a compiled LoRASlots, None where no kernel runs (attach() makes
        the slots once it knows the model's layers)."""
        self.max_loras = max_loras
        self._kernel_slots = kernel_slots
        self.slots: Optional[KernelSlots] = None
        self.num_rows = 0
        self.active = False  # some row of this step has an adapter
        # the kernel's way: each row's slot (-1: the base), and the same for the kept rows; None: PyTorch's way
        self.slot_rows: Optional[torch.Tensor] = None
        self.kept_slot_rows: Optional[torch.Tensor] = None
        # PyTorch's way: the groups as one batch, and within the kept rows
        self.batched: Optional[Batched] = None
        self.kept_batched: Optional[Batched] = None
        # (adapters' fingerprints, layer, module) -> the stacked A, B and scalings; only the latest adapter set
        # is kept (a steady batch keeps its set for many steps)
        self._stacks: dict[tuple, Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._stacked_for: tuple = ()

    def attach_kernel(self, num_layers: int) -> None:
        if self._kernel_slots is not None and self.slots is None:
            self.slots = KernelSlots(self._kernel_slots(self.max_loras, num_layers), self.max_loras)

    def kernel_arguments(self) -> tuple:
        """(the compiled LoRASlots, each row's slot) for the compiled decoder stack, which applies the adapters
        as apply() does; () when this step runs PyTorch's way (the stack cannot)."""
        return (self.slots.table, self.slot_rows) if self.slot_rows is not None else ()

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
        self.active = bool(grouped)
        self.slot_rows = self.kept_slot_rows = self.batched = self.kept_batched = None
        if not grouped:
            return
        kernel = self.slots is not None and device.type == "cpu"
        slots = self.slots.slots_of([adapter for adapter, _ in grouped]) if kernel else None
        if slots is not None:
            slot_of = [-1] * num_rows
            for adapter, adapter_rows in grouped:
                for row in adapter_rows:
                    slot_of[row] = slots[adapter.fingerprint]
            self.slot_rows = torch.tensor(slot_of, dtype=torch.int32)
            kept = slot_of if kept_rows is None else [slot_of[row] for row in kept_rows]
            self.kept_slot_rows = torch.tensor(kept, dtype=torch.int32)
            return
        self.batched = _batch(grouped, device)
        if kept_rows is None:
            self.kept_batched = self.batched
            return
        position = {row: index for index, row in enumerate(kept_rows)}
        kept_grouped = []
        for adapter, adapter_rows in grouped:
            kept = [position[row] for row in adapter_rows if row in position]
            if kept:
                kept_grouped.append((adapter, kept))
        self.kept_batched = _batch(kept_grouped, device) if kept_grouped else None

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += this step's adapters' updates of `module` in `layer`, on their rows of x (the module's input)."""
        full = x.shape[0] == self.num_rows
        if self.slot_rows is not None and x.dtype in (torch.float32, torch.bfloat16):
            self.slots.table.apply(
                layer, _MODULE_INDEX[module], x, out, self.slot_rows if full else self.kept_slot_rows
            )
            return
        batched = self.batched if full else self.kept_batched
        if batched is not None:
            self._apply_batched(batched, layer, module, x, out)

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
                options = {"device": present[0].a.device, "dtype": torch.float64}
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


def _batch(grouped: list[tuple[LoRAAdapter, list[int]]], device: torch.device) -> Batched:
    """The adapters' rows as one batch."""
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
    out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta.float()).to(out.dtype))


class LayerLoRA:
    """What one decoder layer's attention or MLP calls after each projection: its layer's updates of this step."""

    def __init__(self, step: LoRAStep, layer: int) -> None:
        self.step = step
        self.layer = layer

    def apply(self, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.step.active:
            self.step.apply(self.layer, module, x, out)


def attach(model, step: LoRAStep) -> None:
    """Give every layer of `model` (llama.py's) the step's updates, and the step the compiled kernel's slots (which
    the compiled decoder stack applies too: kernel_arguments)."""
    step.attach_kernel(len(model.layers))
    for index, layer in enumerate(model.layers):
        layer.self_attn.lora = LayerLoRA(step, index)
        layer.mlp.lora = LayerLoRA(step, index)
    model.lora_step = step
