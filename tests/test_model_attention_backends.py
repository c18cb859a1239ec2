"""The attention backend: chosen once per engine from the pool's dtype and device, then planned once a step.

compiled where the kernel takes the pool; else invariant for bf16 on the CPU with batch invariance asked for;
else the cascade. Every backend answers a mixed step as dense attention does, and an engine never asks for
another backend after it starts.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.model import AttentionMetadata, kernels, write_kv
from prefixserve.model.attention import paged, partials
from prefixserve.model.attention.cascade import CascadeAttention
from prefixserve.model.attention.compiled import CompiledAttention
from prefixserve.model.attention.invariant import InvariantAttention
from prefixserve.model.families import decoder_stack, llama

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16


def pool(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_choice_follows_the_pool_and_batch_invariance(monkeypatch, dtype, batch_invariant):
    if kernels.compiled is not None:
        chosen = paged.choose_backend(pool(dtype), batch_invariant)
        assert isinstance(chosen, CompiledAttention) and chosen.name == "compiled"
    monkeypatch.setattr(paged, "causal_kernel_for", lambda k_cache: None)
    chosen = paged.choose_backend(pool(dtype), batch_invariant)
    invariant = dtype == torch.bfloat16 and batch_invariant and partials.CPU_FLASH is not None
    assert type(chosen) is (InvariantAttention if invariant else CascadeAttention)
    monkeypatch.setattr(partials, "CPU_FLASH", None)
    monkeypatch.setattr(paged, "CPU_FLASH", None)
    assert type(paged.choose_backend(pool(dtype), batch_invariant)) is CascadeAttention


def mixed_step(dtype: torch.dtype, seed: int = 0):
    """A fresh prefill, a continued one and two decodes (one with 300 keys: past a 256-key segment)."""
    generator = torch.Generator().manual_seed(seed)
    specs = [(0, 20), (37, 9), (299, 1), (40, 1)]  # (cached tokens, new tokens)
    k_cache = torch.full((64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, contexts, next_block = [], [], 0
    for cached, new in specs:
        num_blocks = -(-(cached + new) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks))[::-1])  # scattered: descending ids
        next_block += num_blocks
        k = torch.randn(cached + new, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(cached + new, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        contexts.append((k, v))
    meta = AttentionMetadata.build([n for _, n in specs], [c + n for c, n in specs], tables, BLOCK_SIZE)
    for (cached, new), table, (k, v) in zip(specs, tables, contexts):  # the cached part, written earlier
        past = AttentionMetadata.build([cached + new], [cached + new], [table], BLOCK_SIZE)
        write_kv(k, v, k_cache, v_cache, past.slot_mapping)
    q = torch.randn(meta.num_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    new_k = torch.cat([k[c:] for (c, _), (k, _) in zip(specs, contexts)])
    new_v = torch.cat([v[c:] for (c, _), (_, v) in zip(specs, contexts)])
    return q, k_cache, v_cache, meta, new_k, new_v, specs, contexts


def dense(q, specs, contexts, scale):
    out, start = [], 0
    for (cached, new), (k, v) in zip(specs, contexts):
        keys = k.double().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        values = v.double().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + new].double(), keys) * scale
        positions = torch.arange(cached, cached + new)[:, None]
        scores = scores.masked_fill(torch.arange(cached + new)[None, :] > positions, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += new
    return torch.cat(out)


def backends(dtype: torch.dtype) -> list:
    found = [CascadeAttention()]
    if dtype == torch.bfloat16 and partials.CPU_FLASH is not None:
        found.append(InvariantAttention())
    causal = kernels.causal_kernel_for(pool(dtype))
    if causal is not None:
        found.append(CompiledAttention(causal))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_answers_a_mixed_step_as_dense_attention(dtype):
    q, k_cache, v_cache, meta, new_k, new_v, specs, contexts = mixed_step(dtype)
    scale = HEAD_DIM**-0.5
    expected = dense(q, specs, contexts, scale).float()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for backend in backends(dtype):
        plan = backend.plan(meta, k_cache)
        out = backend.forward(q, k_cache, v_cache, meta, scale, plan, new_k, new_v)
        assert out.dtype == dtype and not out.isnan().any(), backend.name
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance, msg=backend.name)
        # the plan is reused by the next layer: the same answer again
        assert torch.equal(backend.forward(q, k_cache, v_cache, meta, scale, plan, new_k, new_v), out), backend.name


@pytest.mark.usefixtures("attention_path")
def test_an_engine_chooses_once_and_says_which(monkeypatch):
    llm = make_llm()
    chosen = llm.engine.runner.attention
    assert chosen.name == ("compiled" if paged.causal_kernel_for(pool(torch.float32)) is not None else "cascade")
    assert f"attention {chosen.name};" in llm.engine.startup_summary
    asked = []
    monkeypatch.setattr(llama, "choose_backend", lambda *args: asked.append(args))
    monkeypatch.setattr(paged, "choose_backend", lambda *args: asked.append(args))
    used = []
    monkeypatch.setattr(decoder_stack, "run", lambda *args, real=decoder_stack.run: used.append(1) or real(*args))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 10 + n))} for n in (40, 70)], params, use_tqdm=False)
    assert not asked and llm.engine.runner.attention is chosen
    if not isinstance(chosen, CompiledAttention):  # the compiled stack runs the kernel inside: never for another
        assert not used
