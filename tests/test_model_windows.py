"""Sliding-window attention (issue 27): a row at position p reads keys (p - window, p], in the compiled
kernel of every variant this CPU runs and on the pure-PyTorch path, against dense attention in float64; and
Gemma 2's soft-capped scores (softcap tanh(s / softcap)) on both paths, with and without a window.

Every slot below the lowest key a sequence's rows may read holds NaN, as a block released from the window
would: a kernel that read one would return NaN.
"""

from __future__ import annotations

import pytest
import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.windowed import windowed_attention

SPECS = [(0, 45), (30, 7), (70, 1), (5, 33), (0, 1), (100, 40), (64, 1)]  # (past, query_len) per sequence


def scattered_cache(specs, window, block_size, num_kv_heads, head_dim, generator):
    """(k_cache, v_cache, tables): each sequence's keys in scattered blocks, NaN below its rows' windows and in
    every slot no sequence owns."""
    lengths = [past + new for past, new in specs]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[order.pop() for _ in range(-(-n // block_size))] for n in lengths]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, (past, new) in zip(tables, specs):
        lowest = max(0, past + 1 - window)  # the first row's first key
        for p in range(lowest, past + new):
            k_cache[table[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=generator)
            v_cache[table[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=generator)
    return k_cache, v_cache, tables


def dense_windowed(q_rows, k_cache, v_cache, table, past, new, window, scale, softcap=None):
    """float64 attention of the rows at positions past .. past + new - 1 over keys (p - window, p]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q_rows.shape[1] // num_kv_heads
    lowest = max(0, past + 1 - window)
    positions = torch.arange(lowest, past + new)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q_rows.double(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(past, past + new)[:, None]
    hidden = (positions[None, :] > rows) | (positions[None, :] <= rows - window)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), values).float()


def call_args(specs, tables, q):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    query_start = torch.tensor([0] + [new for _, new in specs]).cumsum(0)
    return padded, query_start, torch.tensor([past + new for past, new in specs])


@pytest.mark.parametrize("window", [1, 7, 31, 32, 33, 64, 1000])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (24, 4), (32, 1), (96, 16), (128, 8), (256, 8)])
def test_the_kernel_reads_each_rows_window_and_nothing_below_it(window, head_dim, block_size, kernel_variant):
    generator = torch.Generator().manual_seed(window * 100 + head_dim + block_size)
    num_heads, num_kv_heads = 4, 2
    k_cache, v_cache, tables = scattered_cache(SPECS, window, block_size, num_kv_heads, head_dim, generator)
    q = torch.randn(sum(new for _, new in SPECS), num_heads, head_dim, generator=generator)
    padded, query_start, seq_lens = call_args(SPECS, tables, q)
    scale = head_dim**-0.5
    out = kernel_variant.paged_causal(q, k_cache, v_cache, padded, query_start, seq_lens, scale, window)
    for i, ((past, new), table) in enumerate(zip(SPECS, tables)):
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        expected = dense_windowed(q[rows], k_cache, v_cache, table, past, new, window, scale)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [7, 40])
def test_the_pure_path_reads_each_rows_window(window):
    generator = torch.Generator().manual_seed(window)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    k_cache, v_cache, tables = scattered_cache(SPECS, window, block_size, num_kv_heads, head_dim, generator)
    q = torch.randn(sum(new for _, new in SPECS), num_heads, head_dim, generator=generator)
    meta = AttentionMetadata.build([new for _, new in SPECS], [past + new for past, new in SPECS], tables, block_size)
    out = windowed_attention(q, k_cache, v_cache, meta, head_dim**-0.5, window)
    starts = meta.query_start_loc.tolist()
    for i, ((past, new), table) in enumerate(zip(SPECS, tables)):
        expected = dense_windowed(
            q[starts[i] : starts[i + 1]], k_cache, v_cache, table, past, new, window, head_dim**-0.5
        )
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_rows_bits_are_its_own_in_any_chunking_or_decode(dtype, kernel_variant):
    """Items start at their lowest row's window: a row's sums must not depend on where that is."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, num_heads, head_dim, length, window = 16, 2, 4, 64, 150, 40
    k_cache = torch.randn(20, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(20, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(20, generator=generator)[: -(-length // block_size)][None]
    q = torch.randn(length, num_heads, head_dim, generator=generator).to(dtype)

    def rows(splits):
        pieces, start = [], 0
        for stop in splits:
            pieces.append(
                kernel_variant.paged_causal(
                    q[start:stop],
                    k_cache,
                    v_cache,
                    table,
                    torch.tensor([0, stop - start]),
                    torch.tensor([stop]),
                    0.125,
                    window,
                )
            )
            start = stop
        return torch.cat(pieces)

    whole = rows([length])
    for splits in ([33, 34, 100, length], [1, 70, 71, length], list(range(1, length + 1))):
        assert torch.equal(rows(splits), whole), splits


@pytest.mark.parametrize("window", [0, 33])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (24, 4), (128, 8)])
def test_capped_scores_on_the_kernel_and_the_pure_path(window, head_dim, block_size, kernel_variant):
    """Scores of a few units against a cap of 3: tanh's series (|s| < 1.2) and its exponential form both run."""
    generator = torch.Generator().manual_seed(head_dim + window)
    num_heads, num_kv_heads, softcap = 4, 2, 3.0
    reach = window or 10_000
    k_cache, v_cache, tables = scattered_cache(SPECS, reach, block_size, num_kv_heads, head_dim, generator)
    q = torch.randn(sum(new for _, new in SPECS), num_heads, head_dim, generator=generator) * 2
    padded, query_start, seq_lens = call_args(SPECS, tables, q)
    scale = head_dim**-0.5
    out = kernel_variant.paged_causal(q, k_cache, v_cache, padded, query_start, seq_lens, scale, window, softcap)
    meta = AttentionMetadata.build([new for _, new in SPECS], [past + new for past, new in SPECS], tables, block_size)
    pure = windowed_attention(q, k_cache, v_cache, meta, scale, window or None, softcap)
    uncapped = kernel_variant.paged_causal(q, k_cache, v_cache, padded, query_start, seq_lens, scale, window)
    for i, ((past, new), table) in enumerate(zip(SPECS, tables)):
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        expected = dense_windowed(q[rows], k_cache, v_cache, table, past, new, reach, scale, softcap)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pure[rows], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(uncapped, out, atol=1e-2)  # the cap changed the answer
