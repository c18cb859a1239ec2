"""The compiled kernel (prefixserve/csrc/) against plain PyTorch, in every variant this CPU runs, and
that CI builds them.

paged_causal reads each row's keys [0, p + 1) through its sequence's block table; the references are
dense attention in float64 over the same keys, gathered by hand, and the row computed alone. Each
test runs once per variant (the kernel_variant fixture: portable, avx2, avx512, ... as the CPU allows).
"""

from __future__ import annotations

import os

import pytest
import torch

from prefixserve.model import kernels


def test_ci_builds_the_compiled_kernels():
    """`pip install -e .` compiles every variant of this machine; CI must run the best one the CPU (and
    the cap) allows, not fall back in silence."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI a missing compiler only costs speed (a warning is logged)")
    assert kernels.compiled is not None, "prefixserve's kernels were not built by `pip install -e .`"
    assert kernels.available() == tuple(variant.name for variant in kernels.executable())
    assert kernels.variant() == kernels.allowed()[-1].name


def test_paged_causal_refuses_what_it_cannot_read(kernel_variant):
    k_cache = torch.zeros(6, 4, 2, 16)
    q = torch.zeros(3, 4, 16)
    tables, query_start, seq_lens = torch.tensor([[1, 2]]), torch.tensor([0, 3]), torch.tensor([7])
    causal = kernel_variant.paged_causal
    causal(q, k_cache, k_cache, tables, query_start, seq_lens, 0.25)  # what follows differs in one thing each
    with pytest.raises(RuntimeError, match="power of two"):
        odd = torch.zeros(6, 3, 2, 16)
        causal(q, odd, odd, tables, query_start, seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        causal(q.double(), k_cache, k_cache, tables, query_start, seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        causal(q, k_cache, k_cache, tables + 5, query_start, seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="outside the block table"):
        causal(q, k_cache, k_cache, tables, query_start, torch.tensor([9]), 0.25)
    with pytest.raises(RuntimeError, match="query_len <= seq_len"):
        causal(q, k_cache, k_cache, tables, query_start, torch.tensor([2]), 0.25)
    with pytest.raises(RuntimeError, match="cover q's rows"):
        causal(q, k_cache, k_cache, tables, torch.tensor([0, 2]), seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        causal(q, k_cache, k_cache, tables.int(), query_start, seq_lens, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48, 20])  # bf16 pairs (AVX512_BF16), floats, the scalar path
def test_paged_causal_rows_are_alike_in_any_chunking_batch_or_decode(dtype, head_dim, kernel_variant):
    """A row at position p reads keys [0, p + 1): its bits must not depend on the chunk it came in,
    the sequences beside it, or whether it is a decode (rows are computed in blocks of up to 32 that
    share each key tile; every row sums in one order). float32 also matches dense attention."""
    generator = torch.Generator().manual_seed(11)
    block_size, num_kv_heads, num_heads, length = 16, 4, 8, 150
    num_blocks = 40
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(num_blocks, generator=generator)[: -(-length // block_size)]
    q = torch.randn(length, num_heads, head_dim, generator=generator).to(dtype)

    def causal(splits, neighbours=0):
        """The rows of `length` positions computed in chunks ending at `splits`, each chunk beside
        `neighbours` copies of a 37-row chunk of another sequence (the same blocks, other positions)."""
        rows, start = [], 0
        for stop in splits:
            seqs = [(start, stop)] + [(0, 37)] * neighbours
            chunk_q = torch.cat([q[a:b] for a, b in seqs])
            query_start = torch.tensor([0] + [b - a for a, b in seqs]).cumsum(0)
            seq_lens = torch.tensor([b for _, b in seqs])
            tables = table.expand(len(seqs), -1).contiguous()
            out = kernel_variant.paged_causal(chunk_q, k_cache, v_cache, tables, query_start, seq_lens, 0.125)
            rows.append(out[: stop - start])
            start = stop
        return torch.cat(rows)

    whole = causal([length])
    for splits, neighbours in [
        ([64, 65, 130, length], 0),
        ([1, 17, 40, 41, 149, length], 2),
        (list(range(1, length + 1)), 0),
        ([length], 3),
    ]:
        assert torch.equal(causal(splits, neighbours), whole), (splits, neighbours)
    if dtype == torch.float32:
        keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:length].double().repeat_interleave(2, 1)
        values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:length].double().repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * 0.125
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float()
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [
        (8, 4, 64, 16),  # the built-in model's shape
        (9, 3, 64, 32),  # 3:1 groups
        (4, 4, 16, 1),  # no grouping, one-token blocks
        (6, 2, 24, 4),  # head_dim not a multiple of 16 (AVX-512: the scalar loop)
        (4, 2, 20, 16),  # not a multiple of 8 or 4: the scalar loop everywhere
        (4, 2, 48, 8),  # three registers of values per vector
        (8, 1, 128, 8),  # one KV head, wide heads
    ],
)
def test_paged_causal_matches_dense_attention_in_float32(num_heads, num_kv_heads, head_dim, block_size, kernel_variant):
    """Prefill chunks with and without a past, and decodes, in one call, over scattered blocks whose
    every unowned slot is NaN: each row matches dense causal attention in float64."""
    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim * 10 + block_size)
    specs = [(0, 45), (30, 7), (70, 1), (5, 33), (0, 1), (100, 40)]  # (past, query_len) per sequence
    lengths = [past + new for past, new in specs]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    order = (torch.randperm(num_blocks, generator=generator)).tolist()
    tables = [[order.pop() for _ in range(-(-n // block_size))] for n in lengths]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for table, n in zip(tables, lengths):
        for p in range(n):
            k_cache[table[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=generator)
            v_cache[table[p // block_size], p % block_size] = torch.randn(num_kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(new for _, new in specs), num_heads, head_dim, generator=generator)
    query_start = torch.tensor([0] + [new for _, new in specs]).cumsum(0)
    scale = head_dim**-0.5
    out = kernel_variant.paged_causal(q, k_cache, v_cache, padded, query_start, torch.tensor(lengths), scale)
    group = num_heads // num_kv_heads
    for i, ((past, new), table) in enumerate(zip(specs, tables)):
        positions = torch.arange(past + new)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), keys) * scale
        future = positions[None, :] > torch.arange(past, past + new)[:, None]
        expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), values)
        torch.testing.assert_close(out[rows], expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
def test_paged_causal_decodes_sharing_a_prefix_are_each_as_alone(dtype, block_size, kernel_variant):
    """Decodes whose tables start with the same blocks share each transposed key tile (one work item);
    tables diverge at different depths, within a 32-key step or at its edge. Every decode's bits
    equal those it gets alone, and float32 matches dense attention."""
    generator = torch.Generator().manual_seed(block_size)
    num_kv_heads, num_heads, head_dim = 2, 4, 64
    shared = torch.arange(1, 1 + 96 // block_size).tolist()  # a 96-token prefix, blocks 1, 2, ...
    spare = iter(range(len(shared) + 1, 400))
    # (blocks kept from the shared prefix, length): diverging after 96, 40, 50 (mid-step), 64, 0 tokens
    specs = [
        (len(shared), 130),
        (len(shared), 97),
        (40 // block_size, 75),
        (48 // block_size, 51),
        (64 // block_size, 200),
        (0, 33),
        (len(shared), 96),
    ]
    tables, lengths = [], []
    for kept, length in specs:
        table = shared[:kept]
        table += [next(spare) for _ in range(-(-length // block_size) - len(table))]
        tables.append(table)
        lengths.append(length)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(400, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(400, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(len(specs), num_heads, head_dim, generator=generator).to(dtype)
    together = kernel_variant.paged_causal(
        q, k_cache, v_cache, padded, torch.arange(len(specs) + 1), torch.tensor(lengths), 0.125
    )
    for i, length in enumerate(lengths):
        alone = kernel_variant.paged_causal(
            q[i : i + 1], k_cache, v_cache, padded[i : i + 1], torch.tensor([0, 1]), torch.tensor([length]), 0.125
        )
        assert torch.equal(alone[0], together[i]), i
        if dtype == torch.float32:
            positions = torch.arange(length)
            slots = padded[i][positions // block_size] * block_size + positions % block_size
            keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(2, 1)
            values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(2, 1)
            scores = torch.einsum("hd,khd->hk", q[i].double(), keys) * 0.125
            expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values).float()
            torch.testing.assert_close(together[i], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [3, 12, 40])
def test_decodes_sharing_a_prefix_split_over_threads_are_each_as_alone(num_decodes, kernel_variant):
    """Decodes on one prefix go in smaller work items when a step has too few items for its threads (items of
    32, 16, 8 or 4 rows, by thread count and batch): every decode's bits stay those it gets alone, whatever the
    thread count."""
    generator = torch.Generator().manual_seed(num_decodes)
    num_kv_heads, num_heads, head_dim, block_size = 3, 9, 64, 16
    prefix = list(range(1, 9))  # 128 shared tokens
    lengths = [128 + 1 + (7 * i) % 40 for i in range(num_decodes)]
    tables = [prefix + [100 + 4 * i + j for j in range(3)] for i in range(num_decodes)]
    k_cache = torch.randn(300, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(300, block_size, num_kv_heads, head_dim, generator=generator)
    q = torch.randn(num_decodes, num_heads, head_dim, generator=generator)
    args = (k_cache, v_cache, torch.tensor(tables), torch.arange(num_decodes + 1), torch.tensor(lengths), 0.125)
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2, 3, 8):
            torch.set_num_threads(num_threads)
            results.append(kernel_variant.paged_causal(q, *args))
    finally:
        torch.set_num_threads(threads)
    for i, length in enumerate(lengths):
        alone = kernel_variant.paged_causal(
            q[i : i + 1],
            k_cache,
            v_cache,
            torch.tensor(tables[i : i + 1]),
            torch.tensor([0, 1]),
            torch.tensor([length]),
            0.125,
        )
        for together in results:
            assert torch.equal(alone[0], together[i]), i


def test_a_kernel_call_leaves_other_python_threads_running(kernel_variant):
    """The engine thread's kernels run with the GIL released (as PyTorch's ops do): while one long
    paged_causal call runs, another thread (the server's event loop answering /health) keeps running.
    The other thread wakes every millisecond and holds the GIL only for a moment, so where the kernel
    held it that thread could run only at the call's edges, never in its middle half."""
    import threading
    import time

    generator = torch.Generator().manual_seed(3)
    block_size, length = 16, 4096
    k_cache = torch.randn(length // block_size, block_size, 4, 64, generator=generator)
    q = torch.randn(length, 8, 64, generator=generator)
    tables = torch.arange(length // block_size).unsqueeze(0)
    query_start, seq_lens = torch.tensor([0, length]), torch.tensor([length])
    stamps: list[float] = []
    done = threading.Event()

    def wake_up_often():
        while not done.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.001)

    other = threading.Thread(target=wake_up_often)
    other.start()
    try:
        start = time.monotonic()
        kernel_variant.paged_causal(q, k_cache, k_cache, tables, query_start, seq_lens, 0.125)
        end = time.monotonic()
    finally:
        done.set()
        other.join()
    middle = [t for t in stamps if start + 0.25 * (end - start) < t < start + 0.75 * (end - start)]
    assert middle, "no other thread ran during the kernel call: it holds the GIL"
