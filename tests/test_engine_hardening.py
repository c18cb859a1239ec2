"""No request can stop the engine: a request that cannot fit finishes instead of livelocking,
a failing step or detokenizer fails only its own requests, and streamed deltas add up."""

import random

import pytest
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.engine.limits import ContextLengthError

POOL_16_MIB = 16 << 20  # 64 blocks x 16 tokens of the built-in fp32 model (16 KiB a token)


def run_to_completion(engine, max_steps):
    """Step until nothing is left (at most `max_steps`); the last output of each request."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def test_max_model_len_is_capped_to_the_pool_and_a_long_request_ends_with_length():
    llm = make_llm(kv_cache_memory_bytes=POOL_16_MIB)
    engine = llm.engine
    assert engine.max_model_len == engine.cache.pool.num_blocks * 16 == 1024
    assert "max_model_len 1024 (capped" in engine.startup_summary
    rng = random.Random(0)
    long_prompt = [rng.randrange(10, 8000) for _ in range(900)]
    with pytest.raises(ContextLengthError, match="reduce the prompt or max_tokens to at most 124"):
        engine.add_request(long_prompt, SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True), "long")
    # max_tokens=None: as many as fit (vLLM's None), the rest of max_model_len
    engine.add_request(long_prompt, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), "long")
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "short")
    finals = run_to_completion(engine, max_steps=200)  # ~1 prefill + 124 decodes, no readmission loop
    assert finals["long"].finish_reason == "length"
    assert len(finals["long"].prompt_token_ids) + len(finals["long"].token_ids) == 1024
    assert finals["short"].finish_reason == "length" and len(finals["short"].token_ids) == 4
    engine.cache.check_integrity()
    assert engine.cache.usage().num_referenced_blocks == 0


def test_an_explicit_max_model_len_beyond_the_pool_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len=2048 does not fit .*kv_cache_memory_bytes"):
        make_llm(kv_cache_memory_bytes=POOL_16_MIB, max_model_len=2048)
    assert make_llm(kv_cache_memory_bytes=POOL_16_MIB, max_model_len=1024).engine.max_model_len == 1024


@pytest.fixture()
def llm():
    return make_llm()


def test_a_failing_model_step_fails_its_requests_alone(llm, monkeypatch):
    engine = llm.engine
    run = engine.runner.execute
    calls = []

    def fail_second_step(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 2:
            raise RuntimeError("simulated kernel failure")
        return run(scheduled)

    monkeypatch.setattr(engine.runner, "execute", fail_second_step)
    params = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True, logprobs=1)
    for name in ("a", "b"):
        engine.add_request("A prompt of a few words", params, name)
    finals = run_to_completion(engine, max_steps=20)
    for name in ("a", "b"):
        assert finals[name].finish_reason == "error" and finals[name].finished
        assert "RuntimeError" in finals[name].error and len(finals[name].token_ids) == 1
    engine.cache.check_integrity()
    assert engine.cache.usage().num_referenced_blocks == 0
    after = llm.generate("A prompt of a few words", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert after.finish_reason == "length" and len(after.token_ids) == 5 and after.error is None
    engine.cache.check_integrity()


def test_a_failing_detokenizer_fails_only_its_request(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("First prompt", params, "broken")
    engine.add_request("Second prompt", params, "fine")

    def explode(*args):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")

    engine.outputs._texts["broken"].update = explode
    finals = run_to_completion(engine, max_steps=20)
    assert finals["broken"].finish_reason == "error" and "UnicodeDecodeError" in finals["broken"].error
    assert finals["fine"].finish_reason == "length" and len(finals["fine"].token_ids) == 6
    engine.cache.check_integrity()
    assert engine.cache.usage().num_referenced_blocks == 0


def test_deltas_add_up_to_the_whole_output(llm):
    engine = llm.engine
    engine.add_request(
        "Counting: one, two,", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2), "r"
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert [t for out in outputs for t in out.delta_token_ids] == final.token_ids
    assert [lp.token_id for out in outputs for lp in out.delta_logprobs] == final.token_ids
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    assert "".join(out.delta_text for out in outputs) == final.text
    assert all(len(out.delta_token_ids) == len(out.delta_logprobs) for out in outputs)
    aborted = engine.add_request("x", SamplingParams(max_tokens=3), "gone")
    assert engine.abort_request(aborted.request_id).delta_token_ids == []
