"""The engine's fast paths keep outputs exact: shared-prefix decoding through the whole engine,
prepacked linear weights, and the bf16-by-default dtype choice."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_llm
from model_helpers import PagedSequences

from prefixserve import SamplingParams
from prefixserve.engine import assembly
from prefixserve.engine.device import resolve_dtype
from prefixserve.model.attention import cascade
from prefixserve.model.attention import paged as attention_module
from prefixserve.model.linear import Linear, float_kernel, native_bfloat16_matmul

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def shared_prompts(num_requests=6, prefix_len=300, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 8000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, 8000) for _ in range(rng.randrange(5, 25))] for _ in range(num_requests)]


def test_shared_prefix_batch_reads_the_prefix_once_and_keeps_outputs(monkeypatch):
    """Six requests after a cached 300-token prefix: on the pure-PyTorch path their decodes and
    prefill chunks take the cascade (the compiled kernel needs no plan), and their tokens equal
    those of an engine without the cache."""
    monkeypatch.setattr(attention_module, "causal_kernel_for", lambda k_cache: None)
    plans = []
    build_plan = cascade.build_plan

    def recording_build_plan(*args):
        plans.append(build_plan(*args))
        return plans[-1]

    monkeypatch.setattr(cascade, "build_plan", recording_build_plan)
    prompts = shared_prompts()
    cached = make_llm()
    cached.generate([prompts[0][:300] + [7]], GREEDY, use_tqdm=False)  # caches the prefix
    outputs = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert all(out.num_cached_tokens == 288 for out in outputs)  # 18 full blocks of 16
    shared = [
        part for plan in plans for part in plan.parts if not isinstance(part.rows, slice) and part.keys.length == 288
    ]
    assert shared, "no step read the shared prefix once for several sequences"

    plain = make_llm(enable_prefix_caching=False)
    expected = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in expected]
    cached.engine.cache.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_weights_match_plain(default_model_dir, dtype):
    from prefixserve.model import load_model

    model = load_model(default_model_dir, dtype, torch.device("cpu")).model
    prompt = list(range(10, 50))
    plain = PagedSequences(model).step([prompt], [0], [[0, 1, 2]])
    assert model.pack_linear_weights(batch_size_hint=64)
    ours = dtype == torch.float32 and float_kernel() is not None  # float32 weights read in place by our kernel
    assert all(
        (module.kernel_weight is not None) if ours else (module.packed is not None)
        for module in model.modules()
        if isinstance(module, Linear)
    )
    packed = PagedSequences(model).step([prompt], [0], [[0, 1, 2]])
    if dtype == torch.bfloat16 and not native_bfloat16_matmul():
        # No bf16 matmul on this CPU: each packed layer is the bf16 matmul's arithmetic in float32, rounded
        # once to bf16 (8 layers of such roundings in another summation order than plain F.linear's
        # MKL flip about one greedy row in 40, so the check is per layer).
        x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
        for module in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj):
            assert module.emulated
            exact = (x.double() @ module.weight.double().T).float()
            torch.testing.assert_close(module(x).float(), exact, rtol=2**-8, atol=1e-6)
        return
    if dtype == torch.bfloat16:  # the same oneDNN kernels, without the per-call weight reorder
        torch.testing.assert_close(packed, plain, atol=0, rtol=0)
    else:  # oneDNN or our kernel instead of MKL: summation order only (logits here are of order 10)
        torch.testing.assert_close(packed, plain, atol=5e-4, rtol=1e-4)
    assert packed.argmax(-1).tolist() == plain.argmax(-1).tolist()


def test_auto_dtype_is_bfloat16_where_the_cpu_scores_and_multiplies_bf16_natively(monkeypatch):
    """auto is the fastest exact dtype: bf16 only with the avx512_bf16 kernels in use (not capped below
    them) and oneDNN's own bf16 matmul (not capped by ONEDNN_MAX_CPU_ISA); float32 elsewhere, where
    bf16 would be exact too but slower (its matmuls run in float32)."""
    from prefixserve.model import kernels, linear

    cpu = torch.device("cpu")
    monkeypatch.setattr(linear, "native_bfloat16_matmul", lambda: True)
    monkeypatch.setattr(kernels, "variant", lambda: "avx512_bf16")
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    for other in ("avx512", "avx2", "portable", "pytorch"):
        monkeypatch.setattr(kernels, "variant", lambda name=other: name)
        assert resolve_dtype("auto", cpu) == torch.float32, other
    monkeypatch.setattr(kernels, "variant", lambda: "avx512_bf16")
    monkeypatch.setattr(linear, "native_bfloat16_matmul", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32  # what the reference tests ask for
    assert assembly.resolve_dtype is resolve_dtype  # the one build_engine calls
