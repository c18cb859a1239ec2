"""Paged attention against dense causal attention, with scattered blocks and padded tables."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model import AttentionMetadata, paged_attention, write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 40
pytestmark = pytest.mark.usefixtures("attention_path")  # attention on the compiled kernels and on the reference paths


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for one sequence: q [query_len, heads, d] are the last rows of k, v [seq_len, kv_heads, d]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("pad_value", [0, -1])
def test_mixed_step_matches_dense(pad_value):
    generator = torch.Generator().manual_seed(0)
    # (cached tokens, new tokens): a fresh prefill, a continued prefill, three decodes of
    # different lengths (one at a block boundary), a one-token fresh prompt.
    shapes = [(0, 9), (6, 7), (12, 1), (3, 1), (23, 1), (0, 1)]
    # Scattered block ids; block 0 (slot 0, a tempting padding target) stays unwritten.
    block_ids = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    tables, contexts = [], []
    for cached, new in shapes:
        num_blocks = -(-(cached + new) // BLOCK_SIZE)
        tables.append([block_ids.pop() for _ in range(num_blocks)])
        contexts.append(torch.randn(cached + new, 2, NUM_KV_HEADS, HEAD_DIM, generator=generator))
    max_blocks = max(len(table) for table in tables)
    padded = [table + [pad_value] * (max_blocks - len(table)) for table in tables]
    # NaN in every unwritten slot: padding must never read one (masking would not hide 0 * NaN).
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))

    # Earlier steps wrote the cached part.
    history = [(cached, 0, table) for (cached, _), table in zip(shapes, tables) if cached]
    meta = AttentionMetadata.build(
        [c for c, _, _ in history], [c for c, _, _ in history], [t for _, _, t in history], BLOCK_SIZE
    )
    cached_kv = torch.cat([kv[:cached] for (cached, _), kv in zip(shapes, contexts) if cached])
    write_kv(cached_kv[:, 0], cached_kv[:, 1], k_cache, v_cache, meta.slot_mapping)

    # This step: every sequence's new tokens in one flat batch.
    meta = AttentionMetadata.build([new for _, new in shapes], [c + n for c, n in shapes], tables, BLOCK_SIZE)
    meta.block_tables = torch.tensor(padded)  # padding value must not matter
    new_kv = torch.cat([kv[cached:] for (cached, _), kv in zip(shapes, contexts)])
    write_kv(new_kv[:, 0], new_kv[:, 1], k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(meta.num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)

    rows = torch.split(torch.arange(meta.num_tokens), [new for _, new in shapes])
    for kv, row in zip(contexts, rows):
        expected = dense_attention(q[row], kv[:, 0], kv[:, 1], scale)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)


def test_build_slot_mapping():
    meta = AttentionMetadata.build([3, 1], [6, 5], [[7, 2], [4, 9]], block_size=4)
    # Sequence 0: positions 3,4,5 -> block 7 offset 3, block 2 offsets 0,1; sequence 1: position 4.
    assert meta.slot_mapping.tolist() == [31, 8, 9, 36]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [6, 5] and meta.seq_lens_list == [6, 5]
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_a_step_of_decodes_builds_what_the_general_path_builds():
    # Decodes only take their slots and positions from the lists; a prefill row among them takes the
    # tensor ops. The same decodes given as the last rows of one-token-longer chunks must map alike.
    tables = [[7, 2, 5], [4, 9], [3], [11, 12]]
    seq_lens = [9, 8, 1, 5]  # a block's last slot, a block boundary, a first token, a block's first slot
    decodes = AttentionMetadata.build([1] * 4, seq_lens, tables, block_size=4)
    assert decodes.positions.tolist() == [8, 7, 0, 4]
    assert decodes.slot_mapping.tolist() == [20, 39, 12, 48]
    assert decodes.query_start_loc.tolist() == [0, 1, 2, 3, 4] and decodes.first_slot is None
    mixed = AttentionMetadata.build([2, 1, 1, 1], seq_lens, tables, block_size=4)  # the general path
    assert mixed.slot_mapping.tolist()[1:] == decodes.slot_mapping.tolist()
    assert mixed.positions.tolist()[1:] == decodes.positions.tolist()
    assert decodes.block_tables.tolist() == mixed.block_tables.tolist()
    for meta in (decodes, mixed):
        assert all(t.dtype == torch.int64 for t in (meta.positions, meta.slot_mapping, meta.block_tables))
    consecutive = AttentionMetadata.build([1, 1], [2, 3], [[5], [5]], block_size=4)
    assert consecutive.slot_mapping.tolist() == [21, 22] and consecutive.first_slot == 21
