"""A cache hit never changes an output: cache on/off, cold/warm, batch mixes, chunk splits."""

import random

import pytest
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.model.attention.cascade import CascadeAttention
from prefixserve.model.attention.invariant import InvariantAttention

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def token_prompts(seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(10, 8000) for _ in range(70)]  # 4 full blocks + 6
    return [system + [rng.randrange(10, 8000) for _ in range(rng.randrange(3, 30))] for _ in range(4)]


@pytest.fixture(scope="module")
def baseline():
    llm = make_llm(enable_prefix_caching=False)
    return [out.token_ids for out in llm.generate(token_prompts(), GREEDY, use_tqdm=False)]


def test_cache_off_reports_no_hits(baseline):
    llm = make_llm(enable_prefix_caching=False)
    for _ in range(2):
        outs = llm.generate(token_prompts(), GREEDY, use_tqdm=False)
        assert [out.token_ids for out in outs] == baseline
        assert all(out.num_cached_tokens == 0 for out in outs)


def test_warm_cache_hits_and_keeps_outputs(baseline):
    llm = make_llm()
    cold = llm.generate(token_prompts(), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in cold] == baseline
    warm = llm.generate(token_prompts(), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in warm] == baseline
    for out in warm:  # every full block before the last prompt token is reused
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16
    # Within the cold batch the shared 64-token system prompt was computed by all four at once
    # (same step), so the hits show up only on the warm pass.
    llm.engine.cache.check_integrity()


def test_one_at_a_time_then_mixed_batch(baseline):
    llm = make_llm()
    prompts = token_prompts()
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    assert first.token_ids == baseline[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [out.token_ids for out in rest] == baseline[1:]
    assert all(out.num_cached_tokens >= 64 for out in rest)


@pytest.mark.parametrize("budget", [16, 17, 32, 45, 64])
def test_chunked_prefill_at_and_inside_block_boundaries(baseline, budget):
    llm = make_llm(max_num_batched_tokens=budget)
    outs = llm.generate(token_prompts(), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outs] == baseline
    warm = llm.generate(token_prompts(), GREEDY, use_tqdm=False)
    assert [out.token_ids for out in warm] == baseline
    llm.engine.cache.check_integrity()


def test_lpm_policy_gives_same_outputs(baseline):
    llm = make_llm(scheduling_policy="lpm", max_num_seqs=2)
    assert [out.token_ids for out in llm.generate(token_prompts(), GREEDY, use_tqdm=False)] == baseline


def test_generated_output_blocks_are_cached_too():
    llm = make_llm()
    prompt = token_prompts(1)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    follow_up = prompt + first.token_ids + [17, 18, 19]
    second = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    # The last output token's KV is never computed (nothing ran after it was sampled).
    computed = len(prompt) + len(first.token_ids) - 1
    assert second.num_cached_tokens == computed // 16 * 16


def bfloat16_case(seed: int, prefix_len: int, num_prompts: int, max_tokens: int):
    """(prompts sharing a random prefix, run(llm, batch) -> greedy token ids, the cache-off baseline) in
    bfloat16 (exact on every CPU: without bf16 matmuls, linear.py multiplies in float32)."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 8000) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(10, 8000) for _ in range(rng.randrange(3, 30))] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(llm, batch):
        return [out.token_ids for out in llm.generate(batch, params, use_tqdm=False)]

    return prompts, run, run(make_llm(dtype="bfloat16", enable_prefix_caching=False), prompts)


def skip_unmeasured(attention_path: str) -> None:
    from prefixserve.model.attention import invariant as invariant_attention

    if attention_path == "reference" and not invariant_attention.measured_here():
        pytest.skip(
            "bf16's pure-PyTorch path is exact only where it was measured (AVX-512 libraries); "
            "the engine refuses it elsewhere (test_bfloat16_without_kernels_is_refused_where_unmeasured)"
        )


# attention_path: the compiled kernel (csrc/paged_causal.cpp) and invariant_attention.py
def test_bfloat16_cache_hits_keep_outputs(attention_path):
    """bfloat16 too: attention's batch-invariant path (compiled, or model/attention/invariant.py) and the
    measured row calls of the linear layers (model/row_calls.py) keep a token's numbers the same in any
    batch, chunk split or decode.
    Without them 0-15% of such requests kept their tokens (benchmarks/bf16_cache_agreement.py)."""
    skip_unmeasured(attention_path)
    prompts, run, baseline = bfloat16_case(seed=3, prefix_len=150, num_prompts=4, max_tokens=24)
    llm = make_llm(dtype="bfloat16")
    assert run(llm, prompts[:1]) + run(llm, prompts[1:]) == baseline  # the rest hit the first's prefix
    assert run(llm, prompts) == baseline  # warm
    chunked = make_llm(dtype="bfloat16", max_num_batched_tokens=45)
    assert run(chunked, prompts) == baseline
    assert run(chunked, prompts) == baseline


def test_bfloat16_shared_segments_keep_outputs(attention_path):
    """Past 256 keys bf16 attention reads whole 256-key segments, once for all the rows whose blocks
    hold them (the invariant cascade): 20 requests over a 300-token prefix read it in one call of 2
    entries with caching on, and each its own copy with caching off; their tokens must not differ."""
    skip_unmeasured(attention_path)
    prompts, run, baseline = bfloat16_case(seed=5, prefix_len=300, num_prompts=20, max_tokens=12)
    llm = make_llm(dtype="bfloat16")
    assert run(llm, prompts[:1]) + run(llm, prompts[1:]) == baseline
    assert run(make_llm(dtype="bfloat16", max_num_batched_tokens=45), prompts) == baseline


def test_bfloat16_without_kernels_is_refused_where_unmeasured(monkeypatch):
    """No compiled kernel and a CPU (or library caps) the invariant path was not measured on: a ValueError
    naming --dtype float32, never an engine whose cache hits may change outputs. Opting out is allowed."""
    from prefixserve.model import kernels
    from prefixserve.model.attention import invariant as invariant_attention

    monkeypatch.setattr(kernels, "compiled", None)
    monkeypatch.setattr(invariant_attention, "measured_here", lambda: False)
    with pytest.raises(ValueError, match="--dtype float32"):
        make_llm(dtype="bfloat16")
    make_llm(dtype="bfloat16", batch_invariant=False)
    make_llm(dtype="float32")
    monkeypatch.setattr(invariant_attention, "measured_here", lambda: True)
    make_llm(dtype="bfloat16")


def _recording(forward, calls: list):
    """A backend's forward that first notes the backend's name in `calls`."""

    def recorded(self, *args, **kwargs):
        calls.append(self.name)
        return forward(self, *args, **kwargs)

    return recorded


def test_batch_invariant_false_takes_the_faster_bfloat16_path(monkeypatch):
    """batch_invariant=False (--no-batch-invariant) is the opt-out: no one-row Linear rule and, on the
    pure-PyTorch path, no invariant attention call; the default takes both. (The compiled kernel's
    attention is batch-invariant either way. Whether outputs then differ depends on the CPU.)"""
    import prefixserve.model.attention.paged as attention
    from prefixserve.model.attention import partials
    from prefixserve.model.linear import Linear

    if partials.CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash attention: the invariant path is never taken")
    monkeypatch.setattr(attention, "causal_kernel_for", lambda k_cache: None)
    calls = []
    for backend in (CascadeAttention, InvariantAttention):
        monkeypatch.setattr(backend, "forward", _recording(backend.forward, calls))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 90))
    fast = make_llm(dtype="bfloat16", batch_invariant=False)
    assert fast.engine.runner.attention.name == "cascade"
    assert all(
        not module.batch_invariant for module in fast.engine.runner.model.modules() if isinstance(module, Linear)
    )
    fast.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert calls and set(calls) == {"cascade"}
    exact = make_llm(dtype="bfloat16")
    assert exact.engine.runner.attention.name == "invariant"
    assert all(module.batch_invariant for module in exact.engine.runner.model.modules() if isinstance(module, Linear))
    calls.clear()
    exact.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert calls and set(calls) == {"invariant"}
    fast.reload(None)  # a reloaded model keeps the engine's choice
    assert all(
        not module.batch_invariant for module in fast.engine.runner.model.modules() if isinstance(module, Linear)
    )
