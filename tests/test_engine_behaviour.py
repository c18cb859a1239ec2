"""Multi-turn reuse, memory pressure, sampling options and bad input through the offline API."""

import random

import pytest
from conftest import make_llm

from prefixserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_second_chat_turn_reuses_first_turn_and_its_answer(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    turn1 = [
        {"role": "system", "content": "You are a terse assistant. " * 6},
        {"role": "user", "content": "Name three prime numbers."},
    ]
    first = llm.chat(turn1, params, use_tqdm=False)[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three more?"}]
    second = llm.chat(turn2, params, use_tqdm=False)[0]
    # The rendered turn-1 prompt is a prefix of turn 2; the answer re-tokenizes the same way
    # up to the first token where byte-level BPE merges differ, so count the shared tokens.
    shared = 0
    for a, b in zip(first.prompt_token_ids + first.token_ids, second.prompt_token_ids):
        if a != b:
            break
        shared += 1
    assert shared > len(first.prompt_token_ids)
    assert second.num_cached_tokens == min(shared, len(first.prompt_token_ids) + len(first.token_ids) - 1) // 16 * 16
    assert second.num_cached_tokens > len(first.prompt_token_ids) - 16


def test_tiny_pool_completes_everything_through_eviction_and_preemption():
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 8000) for _ in range(40)] for _ in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make_llm()
    expected = [out.token_ids for out in roomy.generate(prompts, params, use_tqdm=False)]
    block_bytes = 16 * 16384  # one block of 16 tokens: 16 KiB a token (fp32, 8 layers, 4 KV heads of 64)
    # 10 blocks: three 40-token prompts (3 blocks each) are admitted, then cannot all grow to 4.
    tight = make_llm(kv_cache_memory_bytes=10 * block_bytes)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.cache.stats.num_evicted_blocks > 0
    tight.engine.cache.check_integrity()
    assert tight.engine.cache.usage().num_referenced_blocks == 0


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm):
    prompt = "Once upon a time"
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], sampled, use_tqdm=False)
    assert a.token_ids == b.token_ids
    other = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True), use_tqdm=False
    )[0]
    assert other.token_ids != a.token_ids
    greedy = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    top1 = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_strings_and_stop_token_ids(llm):
    greedy = llm.generate(["Hello"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    stop_token = greedy.token_ids[5]
    by_token = llm.generate(
        ["Hello"],
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0]
    first = greedy.token_ids.index(stop_token)
    assert by_token.token_ids == greedy.token_ids[: first + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token
    stop_text = greedy.text[len(greedy.text) // 2 : len(greedy.text) // 2 + 3]
    by_text = llm.generate(
        ["Hello"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_text]), use_tqdm=False
    )[0]
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_text
    assert by_text.text == greedy.text[: greedy.text.index(stop_text)]


def test_prompt_forms_and_cache_salt(llm):
    ids = llm.tokenizer.encode("Shared words in a prompt that is long enough to fill blocks " * 3)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    same = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert same.num_cached_tokens > 0
    salted = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-b"}], params, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0 and salted.token_ids == same.token_ids
    text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    assert llm.generate({"prompt": text}, params, use_tqdm=False)[0].prompt == text


@pytest.mark.parametrize(
    "prompt, params, error, message",
    [
        ("", None, ValueError, "prompt is empty"),
        ([], None, ValueError, "at least one prompt"),
        ([[5, 99999]], None, ValueError, "outside the vocabulary"),
        ([[5] * 5000], None, ValueError, "max_model_len"),
        ("hi", "bad-max-tokens", ValueError, "max_tokens must be an integer of at least 1"),
        ([{"text": "hi"}], None, ValueError, "unknown prompt field"),
        ([3.5], None, TypeError, "a prompt must be"),
    ],
)
def test_bad_input_raises_clear_errors(llm, prompt, params, error, message):
    with pytest.raises(error, match=message):
        if params == "bad-max-tokens":
            params = SamplingParams(max_tokens=0)
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_engine_options_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(max_model_len=10**6)
    with pytest.raises(ValueError, match=r"kv_fetch_policy must be one of \('cost', 'always'\), got 'sometimes'"):
        make_llm(kv_fetch_policy="sometimes")


def test_n_samples_of_a_seeded_request_differ_and_reproduce(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    assert [params.for_sample(i).seed for i in range(3)] == [5, 6, 7]
    assert SamplingParams(n=3).for_sample(2).seed is None
    first = [out.token_ids for out in llm.generate("Sample", params, use_tqdm=False)]
    again = [out.token_ids for out in llm.generate("Sample", params, use_tqdm=False)]
    assert len(first) == 3 and first == again and len({tuple(t) for t in first}) == 3
