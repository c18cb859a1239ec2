"""The row counts a matmul may be called with so that every row's result is its own.

A GEMM library picks its kernel, and so the order of each output's sum, by the shape of the call:
oneDNN's bf16 kernels on AMX CPUs sum a row of a 33..256-row call in another order than the same row
of a 1..32-row or a 1,536-row call; its float32 kernels sum a lone row (K = 1,344) unlike a row of 2+;
MKL's sgemm differs from 2 rows on. Then one token's numbers depend on how many others share its step,
and a cache hit (a shorter step) can change a greedy output. Nothing documents these choices and
they differ by CPU, library version and thread count, so they are measured, once per matmul shape:

    reference   the probe rows x[0 .. R) computed in calls of REFERENCE_ROWS rows
    candidate   calls of C rows (1 .. 32, then sizes growing by 1.5-2x up to the step's token
                budget) over at least PROBE_OUTPUTS outputs' worth of rows; accepted when every
                row equals the reference bit for bit

The probe rows are random, and a different order of a sum changes most float32 outputs. Rounded to
bf16 it changes few (measured: oneDNN's float32 kernel at SSE4.1 sums a lone row unlike a row of 16
in 75% of outputs, which after rounding to bf16 differ in about 1 of 2,688): so a layer that rounds
its float32 sums to bf16 itself is probed before the rounding (linear.py), and where the library
returns bf16 (its own rounding) every size is tried over enough rows that even a one-in-thousands
difference shows (about 48 expected). A call of any other row count
is served by accepted calls: padded with zero rows up to an accepted size when that costs at most a
quarter (or 8) more rows, else split into the largest accepted sizes. Every row then takes the reference's
order whatever its batch. `RowCalls.ALL` is the plan when invariance is not asked for.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Optional

import torch

Matmul = Callable[[torch.Tensor], torch.Tensor]

REFERENCE_ROWS = 16
SMALL_ROWS = 32  # every row count up to this is probed (decode batches)
PROBE_OUTPUTS = 1 << 17  # outputs each candidate size computes at least (its calls repeated over more rows)
MAX_PADDING = 0.25  # pad a call up to an accepted size costing at most this share more rows,
MIN_PADDING = 8  # or this many (a small call's cost is mostly reading the weight)


def candidate_sizes(max_rows: int) -> list[int]:
    """1 .. 32, then 48, 64, 96, 128, ... (x1.5 and x2 in turn) up to max_rows, and max_rows itself."""
    sizes = list(range(1, min(SMALL_ROWS, max_rows) + 1))
    size = SMALL_ROWS
    while True:
        for step in (size * 3 // 2, size * 2):
            if step < max_rows:
                sizes.append(step)
        size *= 2
        if size >= max_rows:
            break
    if max_rows > SMALL_ROWS:
        sizes.append(max_rows)
    return sorted(set(sizes) | {REFERENCE_ROWS})


class Call(NamedTuple):
    rows: int  # rows of the input this call computes
    size: int  # rows it is made with (rows, or more: zero rows padded)


class RowCalls:
    """The accepted call sizes of one matmul shape, and how a call of any row count uses them."""

    ALL: "RowCalls"  # every size accepted: one call of x's own rows (no invariance asked for)

    def __init__(self, accepted: Optional[tuple[int, ...]]) -> None:
        self.accepted = accepted  # ascending; None: every size
        self._plans: dict[int, tuple[Call, ...]] = {}

    def plan(self, rows: int) -> tuple[Call, ...]:
        """The calls that compute `rows` rows, in order."""
        if self.accepted is None or rows == 0:
            return (Call(rows, rows),)
        found = self._plans.get(rows)
        if found is None:
            found = self._plans[rows] = tuple(self._split(rows))
        return found

    def _split(self, rows: int):
        accepted = self.accepted
        while rows > 0:
            larger = next((size for size in accepted if size >= rows), None)
            if larger is not None and larger - rows <= max(rows * MAX_PADDING, MIN_PADDING):
                yield Call(rows, larger)
                return
            smaller = max((size for size in accepted if size <= rows), default=None)
            if smaller is None:  # rows below the smallest accepted size
                yield Call(rows, accepted[0])
                return
            yield Call(smaller, smaller)
            rows -= smaller

    def run(self, matmul: Matmul, x: torch.Tensor) -> torch.Tensor:
        """matmul(x) [rows, N], computed by this plan's calls."""
        calls = self.plan(x.shape[0])
        if len(calls) == 1 and calls[0].size == calls[0].rows:
            return matmul(x)
        outputs, start = [], 0
        for call in calls:
            chunk = x[start : start + call.rows]
            if call.size > call.rows:
                chunk = torch.cat([chunk, chunk.new_zeros(call.size - call.rows, x.shape[1])])
            outputs.append(matmul(chunk)[: call.rows])
            start += call.rows
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def __repr__(self) -> str:
        return "RowCalls(all)" if self.accepted is None else f"RowCalls({list(self.accepted)})"


RowCalls.ALL = RowCalls(None)


def probe(
    matmul: Matmul, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device, max_rows: int
) -> RowCalls:
    """The sizes at which `matmul` computes every row of a call as a REFERENCE_ROWS-row call does."""
    sizes = candidate_sizes(max(max_rows, 1))
    generator = torch.Generator().manual_seed(0x5EED)
    first = torch.randn(1, in_features, generator=generator).to(device=device, dtype=dtype)
    with torch.inference_mode():
        rounded = matmul(first).dtype not in (torch.float32, torch.float64)
    # A float32 result shows another order in most outputs: one call of each size is enough. A result
    # the library rounded to bf16 itself shows it in few: each size is tried over many outputs.
    min_rows = -(-PROBE_OUTPUTS // max(out_features, 1)) if rounded else 1
    rows_of = {size: -(-max(size, min_rows) // size) * size for size in sizes}  # whole calls of `size`
    total = -(-max(rows_of.values()) // REFERENCE_ROWS) * REFERENCE_ROWS
    x = torch.randn(total, in_features, generator=generator).to(device=device, dtype=dtype)

    def calls_of(size: int, rows: int) -> torch.Tensor:
        return torch.cat([matmul(x[start : start + size]) for start in range(0, rows, size)])

    with torch.inference_mode():
        reference = calls_of(REFERENCE_ROWS, total)
        accepted = tuple(
            size
            for size in sizes
            if size == REFERENCE_ROWS or torch.equal(calls_of(size, rows_of[size]), reference[: rows_of[size]])
        )
    return RowCalls(accepted)


_probed: dict[tuple, RowCalls] = {}
_probe_lock = threading.Lock()


def probe_once(
    key: tuple,
    matmul: Matmul,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
) -> RowCalls:
    """probe(), remembered for this process under `key` (everything the library's choice can depend
    on: the shapes, dtypes, weight layout, bias, the thread count; the caller names them)."""
    key = key + (in_features, out_features, dtype, str(device), max_rows, torch.get_num_threads())
    with _probe_lock:
        found = _probed.get(key)
        if found is None:
            found = _probed[key] = probe(matmul, in_features, out_features, dtype, device, max_rows)
        return found
