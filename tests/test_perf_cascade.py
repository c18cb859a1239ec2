"""Shared-prefix (cascade) attention and in-place reads of block runs against the plain path.

Sequences that share leading block ids read those K/V once for all their queries; a run of
consecutive block ids is read as one slice; the rest is gathered. Every way must give the same
numbers as one gathered, masked call per sequence (fp32, 1e-5) and as dense attention.
"""

from __future__ import annotations

import pytest
import torch

from prefixserve.model import AttentionMetadata, write_kv
from prefixserve.model.attention import partials
from prefixserve.model.attention import step_plan as attention_plan
from prefixserve.model.attention.cascade import CascadeAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 2, 16, 4, 200
SCALE = HEAD_DIM**-0.5

# The plan (cascade, views, gathers) is how the cascade backend reads the cache; the compiled kernel reads
# every row in place and needs none (tests/test_model_kernels.py covers it).
CASCADE = CascadeAttention()


def dense_attention(q, k, v):
    """One sequence: q [query_len, heads, d] are the last rows of k, v [seq_len, kv_heads, d]."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.fixture
def eager_thresholds(monkeypatch):
    """Take every shortcut even for the small shapes here (block size 4): a 2-member shared
    prefix of 12 blocks, a consecutive run of 8 blocks."""
    monkeypatch.setattr(attention_plan, "MIN_SHARED_SAVED_TOKENS", {4: 1, 2: 1})
    monkeypatch.setattr(attention_plan, "MIN_VIEW_TOKENS", {4: 8 * BLOCK_SIZE, 2: 8 * BLOCK_SIZE})


class Scenario:
    """Sequences given as (block table, cached tokens, new tokens); K/V of the cached part written."""

    def __init__(self, specs, seed=0, num_blocks=NUM_BLOCKS):
        generator = torch.Generator().manual_seed(seed)
        self.specs = specs
        # NaN everywhere unwritten: no read may touch it.
        self.k_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"))
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        flat_k = self.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
        flat_v = self.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
        self.contexts = []
        for table, cached, new in specs:
            k = torch.randn(cached + new, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            v = torch.randn(cached + new, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            # Shared blocks hold identical K/V in every sequence that lists them.
            for position in range(cached):
                slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                if not torch.isnan(flat_k[slot]).any():
                    k[position], v[position] = flat_k[slot], flat_v[slot]
                flat_k[slot], flat_v[slot] = k[position], v[position]
            self.contexts.append((k, v))
        self.q = torch.randn(sum(new for _, _, new in specs), NUM_HEADS, HEAD_DIM, generator=generator)

    def run(self, pass_new_kv=True):
        meta = AttentionMetadata.build(
            [new for _, _, new in self.specs],
            [c + n for _, c, n in self.specs],
            [table for table, _, _ in self.specs],
            BLOCK_SIZE,
        )
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        new_k = torch.cat([k[cached:] for (_, cached, _), (k, _) in zip(self.specs, self.contexts)])
        new_v = torch.cat([v[cached:] for (_, cached, _), (_, v) in zip(self.specs, self.contexts)])
        write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
        kv = (new_k, new_v) if pass_new_kv else (None, None)
        plan = CASCADE.plan(meta, k_cache)
        return CASCADE.forward(self.q, k_cache, v_cache, meta, SCALE, plan, *kv), plan

    def expected(self):
        rows = torch.split(torch.arange(len(self.q)), [new for _, _, new in self.specs])
        return torch.cat([dense_attention(self.q[row], k, v) for row, (k, v) in zip(rows, self.contexts)])


def shared_scenario():
    """Six sequences over one 40-block prefix (scattered ids), one with its own long run; two
    decodes sharing a 12-block consecutive prefix; one unrelated decode and a fresh prompt."""
    scattered = [int(b) for b in torch.randperm(60, generator=torch.Generator().manual_seed(1))[:40] + 100]
    own = iter(range(1, 100))
    specs = []
    for cached_extra, new in [(0, 1), (5, 1), (17, 1), (3, 7), (2, 30), (9, 7)]:
        cached = 40 * BLOCK_SIZE + cached_extra
        blocks = -(-(cached + new) // BLOCK_SIZE)
        specs.append((scattered + [next(own) for _ in range(blocks - 40)], cached, new))
    specs[4] = (scattered + list(range(60, 73)), 40 * BLOCK_SIZE + 11 * BLOCK_SIZE + 2, 6)  # body run after the prefix
    run = list(range(80, 92))
    specs += [(run + [next(own)], 12 * BLOCK_SIZE + 1, 1), (run + [next(own), next(own)], 12 * BLOCK_SIZE + 3, 5)]
    specs += [([next(own) for _ in range(3)], 9, 1), ([next(own) for _ in range(3)], 0, 11)]
    return specs


@pytest.mark.parametrize("pass_new_kv", [True, False])
def test_cascade_matches_dense_and_plain(monkeypatch, eager_thresholds, pass_new_kv):
    scenario = Scenario(shared_scenario())
    out, plan = scenario.run(pass_new_kv)
    # The 40-block prefix is one part over the rows of all six sequences: read once.
    shared = [part for part in plan.parts if part.keys.slots is not None and len(part.keys.slots) == 40 * BLOCK_SIZE]
    assert len(shared) == 1 and len(shared[0].rows) == 1 + 1 + 1 + 7 + 6 + 7
    # The own tokens of the two 7-token chunks attend causally in one batched call.
    assert sorted(len(batch.rows) for batch in plan.own_batches) == [5, 6, 14]
    # The consecutive 12-block prefix is a view (no slot list), shared by both of its sequences.
    views = [part for part in plan.parts if part.keys.slots is None]
    assert any(part.keys.length == 12 * BLOCK_SIZE and not isinstance(part.rows, slice) for part in views)
    assert any(part.keys.length == 11 * BLOCK_SIZE for part in views)  # the body run
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, scenario.expected(), atol=1e-5, rtol=1e-5)

    monkeypatch.setattr(attention_plan, "MIN_SHARED_SAVED_TOKENS", {4: 10**9, 2: 10**9})
    monkeypatch.setattr(attention_plan, "MIN_VIEW_TOKENS", {4: 10**9, 2: 10**9})
    plain, plain_plan = scenario.run(pass_new_kv)
    assert not plain_plan.parts and plain_plan.merged_rows is None
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_many_decodes_share_one_read():
    """32 decodes over a 2,000-token prefix: one part reads the prefix, the gathered rest is short."""
    prefix = list(range(10, 10 + 2000 // BLOCK_SIZE))
    own = iter(range(600, 900))
    specs = [(prefix + [next(own) for _ in range(7)], 2000 + 20 + i % 7, 1) for i in range(32)]
    scenario = Scenario(specs, seed=3, num_blocks=900)
    out, plan = scenario.run()
    assert len(plan.parts) == 1 and plan.parts[0].keys.length == 2000 and len(plan.parts[0].rows) == 32
    assert plan.decodes.slots.shape == (32, 27)  # at most 20 + 6 past tokens beyond the prefix, + own
    torch.testing.assert_close(out, scenario.expected(), atol=1e-5, rtol=1e-5)


def test_math_fallback_matches_dense(monkeypatch, eager_thresholds):
    """Off the CPU (no fused kernel with log-sum-exp) the parts are computed with plain matmuls."""
    monkeypatch.setattr(partials, "CPU_FLASH", None)
    scenario = Scenario(shared_scenario(), seed=7)
    out, _ = scenario.run()
    torch.testing.assert_close(out, scenario.expected(), atol=1e-5, rtol=1e-5)


def test_bfloat16_cascade_close_to_float32(eager_thresholds):
    scenario = Scenario(shared_scenario(), seed=5)
    out32, _ = scenario.run()
    scenario.k_cache, scenario.v_cache = scenario.k_cache.bfloat16(), scenario.v_cache.bfloat16()
    scenario.q = scenario.q.bfloat16()
    scenario.contexts = [(k.bfloat16(), v.bfloat16()) for k, v in scenario.contexts]
    out16, _ = scenario.run()
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)


def test_positions_from_metadata():
    meta = AttentionMetadata.build([3, 1, 2], [6, 5, 2], [[7, 2], [4, 9], [1]], block_size=4)
    assert meta.positions.tolist() == [3, 4, 5, 4, 0, 1]
    assert meta.slot_mapping.tolist() == [31, 8, 9, 36, 4, 5]


def test_thresholds_measured_on_a_cpu_apply_to_cpus_only():
    assert attention_plan.thresholds("cpu", 4) == (
        attention_plan.MIN_SHARED_SAVED_TOKENS[4],
        attention_plan.MIN_VIEW_TOKENS[4],
    )
    assert attention_plan.thresholds("cuda", 2) == (attention_plan.UNMEASURED_DEVICE, attention_plan.UNMEASURED_DEVICE)
