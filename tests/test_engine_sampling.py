"""Sampling: numerically safe for every accepted value, one source of limits, seeds keyed by
position (a continuation reproduces the original), and logprobs as vLLM and OpenAI define them."""

import math
import types

import pytest
import torch
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.engine.limits import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
)
from prefixserve.engine.sampling import Sampler, position_seed, sample_row
from prefixserve.engine.sampling_params import SAMPLING_EPS

TEMPERATURES = [1e-300, 5e-324, 1e-38, 1e-6, 1e-5, 2.0]
VOCAB = 50


def hostile_rows() -> torch.Tensor:
    """Rows a model could hand the sampler: ordinary, masked, huge, infinite, NaN."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(7, VOCAB, generator=generator)
    rows[0, 7] = 9.0  # ordinary, clear winner 7
    rows[1] = float("-inf")
    rows[1, 3], rows[1, 9] = 1.0, 4.0  # all masked but two: winner 9
    rows[2] = -3e38
    rows[2, 11] = 3e38  # huge, near the float32 limit: winner 11
    rows[3, 5] = float("inf")  # +inf: winner 5
    rows[4] = float("nan")  # NaN row: any token, no exception
    rows[5] = float("-inf")  # nothing allowed: any token, no exception
    rows[6, 20] = float("nan")  # one NaN among numbers
    return rows


WINNERS = {0: 7, 1: 9, 2: 11, 3: 5}


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (3, 1.0), (-1, 0.5)])
def test_no_row_can_raise_at_any_accepted_temperature(temperature, seed, top_k, top_p):
    rows = hostile_rows()
    params = [SamplingParams(temperature=temperature, seed=seed, top_k=top_k, top_p=top_p, logprobs=2)] * len(rows)
    result = Sampler(seed=0).sample(rows, params, positions=list(range(len(rows))))
    assert all(0 <= token < VOCAB for token in result.token_ids)
    if temperature < 1e-3:  # greedy, or so peaked that only the winner has mass
        assert {row: result.token_ids[row] for row in WINNERS} == WINNERS
    assert result.token_ids[3] == 5  # an infinite logit always wins
    assert all(logprob is not None and len(logprob.top) == 2 for logprob in result.logprobs)


@pytest.mark.parametrize("min_p", [0.0, 0.1])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_sampled_path_alone_survives_tiny_temperatures(temperature, min_p):
    # Below SAMPLING_EPS the params are greedy; the sampled path must still be safe if reached.
    param = types.SimpleNamespace(temperature=temperature, top_k=-1, top_p=1.0, min_p=min_p)
    for row, logits in enumerate(hostile_rows()):
        token = sample_row(logits, param, torch.Generator().manual_seed(1))
        assert 0 <= token < VOCAB
        if row in WINNERS and temperature < 1e-3:
            assert token == WINNERS[row]


def test_greedy_below_sampling_eps():
    assert SAMPLING_EPS == 1e-5
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=1e-300).is_greedy
    assert SamplingParams(temperature=9.99e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_seeded_draws_depend_on_seed_and_position_only():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is pure randomness
    sampler = Sampler(seed=0)

    def draw(seed, position):
        return sampler.sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [position]).token_ids[0]

    assert [draw(7, p) for p in range(20)] == [draw(7, p) for p in range(20)]
    assert len({draw(7, p) for p in range(20)}) > 5
    assert [draw(7, p) for p in range(20)] != [draw(8, p) for p in range(20)]
    assert position_seed(7, 3) == position_seed(7 - 2**64, 3)  # seeds are taken modulo 2**64
    # blake2b of little-endian 64-bit words: the same on every platform, so replicas agree.
    assert position_seed(7, 3) == 0x2F425A68C9C449BA and position_seed(-1, 0) == 0x9197AF4BED28AAAA


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"temperature": MAX_TEMPERATURE + 0.01}, "temperature must be a number between 0 and 2.0"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be an integer of at least 1"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": True}, "seed must be an integer between"),
        ({"seed": SEED_MAX + 1}, f"seed must be an integer between {SEED_MIN} and {SEED_MAX}"),
        ({"seed": SEED_MIN - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"n": MAX_N + 1}, f"n must be an integer between 1 and {MAX_N}"),
        ({"n": True}, "n must be"),
        ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs must be an integer between 0 and {MAX_LOGPROBS}"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS} strings"),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, f"at most {MAX_STOP_STRING_CHARS} characters"),
        ({"stop": [""]}, "non-empty"),
        ({"stop": [3]}, "non-empty string"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS} ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_limits_name_the_field_and_the_limit(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**fields)


def test_limits_themselves_are_accepted():
    params = SamplingParams(
        temperature=MAX_TEMPERATURE,
        n=MAX_N,
        logprobs=MAX_LOGPROBS,
        seed=SEED_MAX,
        stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=range(MAX_STOP_TOKEN_IDS),
    )
    assert isinstance(params.stop_token_ids, frozenset) and 255 in params.stop_token_ids
    assert SamplingParams(seed=SEED_MIN, logprobs=0, temperature=0).seed == SEED_MIN
    assert params.for_sample(1).seed == 0  # 2**64 wraps to 0 within 64 bits instead of failing
    assert SamplingParams(seed=3).for_sample(2).seed == 5 and SamplingParams(seed=3).for_sample(0).seed == 3


# ---- through the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_any_accepted_temperature_completes(llm, temperature):
    out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("temperature, extra", [(1.0, {}), (0.0, {}), (0.8, {"top_k": 40, "top_p": 0.9})])
def test_a_continuation_from_the_prompt_plus_k_outputs_reproduces_the_rest(llm, temperature, extra):
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True, **extra)
    original = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    resumed_prompt = original.prompt_token_ids + original.token_ids[:5]
    rest = SamplingParams(max_tokens=7, temperature=temperature, seed=7, ignore_eos=True, **extra)
    resumed = llm.generate([resumed_prompt], rest, use_tqdm=False)[0]
    assert resumed.token_ids == original.token_ids[5:]
    assert len(set(original.token_ids)) > 3  # a real sample, not a repeated token


def test_logprobs_match_transformers_raw_log_softmax(llm, default_model_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    out = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.inference_mode():
        expected = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[len(out.prompt_token_ids) + i - 1]
        assert logprob.token_id == token and logprob.rank == 1
        assert abs(logprob.logprob - row.max().item()) < 1e-4
        assert len(logprob.top) == 5 and logprob.top[0][0] == token
        assert [value for _, value in logprob.top] == sorted((value for _, value in logprob.top), reverse=True)
        for top_id, top_value in logprob.top:
            assert abs(top_value - row[top_id].item()) < 1e-4


def test_logprobs_of_sampled_tokens_rank_them_among_all(llm):
    params = SamplingParams(max_tokens=8, temperature=2.0, seed=1, ignore_eos=True, logprobs=3)
    out = llm.generate("Sample", params, use_tqdm=False)[0]
    for logprob in out.logprobs:
        assert logprob.rank >= 1 and len(logprob.top) == 3 and math.isfinite(logprob.logprob)
        top = dict(logprob.top)
        assert (logprob.rank <= 3) == (logprob.token_id in top)
        assert logprob.logprob <= logprob.top[0][1]
    assert any(logprob.rank > 1 for logprob in out.logprobs)  # temperature 2 strays from the top
    only_chosen = llm.generate("Sample", SamplingParams(max_tokens=2, logprobs=0, seed=1), use_tqdm=False)[0]
    assert [len(logprob.top) for logprob in only_chosen.logprobs] == [0, 0]
    assert llm.generate("Sample", SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None
