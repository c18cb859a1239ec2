"""Sampling fields that change the logits (logit_bias, penalties, min_p, min_tokens, bad_words): each does what
its API documents, checked against transformers' processors or the raw logprobs, and a cache hit changes no
output with any of them."""

import random

import pytest
import torch
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.engine.logits_processors import process_logits
from prefixserve.engine.request import Request

SYSTEM = "You are a careful assistant. Answer in one sentence and repeat nothing. " * 4
PROMPTS = [SYSTEM + f"Question {index}: name a colour." for index in range(3)]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def request_of(prompt, output, **params):
    request = Request("r", list(prompt), SamplingParams(**params), b"scope", eos_token_ids=frozenset({2}))
    request.token_ids += list(output)
    return request


def test_repetition_penalty_min_tokens_and_bad_words_match_transformers():
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    rng = random.Random(0)
    vocab = 50
    for trial in range(40):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 6))]
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        ids = torch.tensor([prompt + output])
        penalty = rng.choice([0.5, 1.3, 2.0])
        ours = process_logits(logits, [request_of(prompt, output, repetition_penalty=penalty)])
        assert torch.equal(ours, RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone()))
        min_tokens = rng.randrange(0, 8)
        ours = process_logits(
            logits, [request_of(prompt, output, min_tokens=min_tokens, max_tokens=16, stop_token_ids=[7])]
        )
        theirs = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [2, 7])(ids, logits.clone())
        assert torch.equal(ours, theirs)
        words = [tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(1, 3))) for _ in range(3)]
        if output:
            words.append(tuple(output[-1:]) + (rng.randrange(3, vocab),))  # ends where the output does
        request = request_of(prompt, output)
        request.bad_words_token_ids = tuple(words)
        ours = process_logits(logits, [request])
        # transformers looks at the whole sequence; ours at the output: give it the output alone
        theirs = NoBadWordsLogitsProcessor([list(word) for word in words], eos_token_id=2)(
            torch.tensor([output or [0]]), logits.clone()
        )
        assert torch.equal(ours, theirs)


def test_rows_without_the_fields_are_left_as_they_are():
    logits = torch.randn(2, 30)
    plain = [request_of([5, 6], [7]), request_of([5], [])]
    assert process_logits(logits, plain) is logits
    biased = process_logits(logits, [plain[0], request_of([5], [], logit_bias={3: 5.0})])
    assert torch.equal(biased[0], logits[0]) and biased[1, 3] == logits[1, 3] + 5.0


@pytest.fixture(scope="module")
def llms():
    """(cache on, cache off) over the built-in model."""
    return make_llm(), make_llm(enable_prefix_caching=False)


def generate(llm, **fields):
    return llm.generate(PROMPTS, SamplingParams(**{**GREEDY, **fields}))


def test_logit_bias_forces_and_bans_tokens(llms):
    llm, _ = llms
    plain = generate(llm)
    first = plain[0].token_ids[0]
    banned = generate(llm, logit_bias={first: -100.0})
    assert all(first not in out.token_ids for out in banned) and banned[0].token_ids != plain[0].token_ids
    forced = generate(llm, logit_bias={42: 100.0})
    assert all(out.token_ids == [42] * 12 for out in forced)


@pytest.mark.parametrize(
    "fields",
    [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(frequency_penalty=0.7, presence_penalty=-0.5)],
)
def test_openai_penalties_pick_the_best_penalized_raw_logprob(llms, fields):
    llm, _ = llms
    bias = {42: 20.0}  # makes token 42 repeat (about 7 of 12 on the built-in model), so penalties act on it
    repeated = sum(out.token_ids.count(42) for out in generate(llm, logit_bias=bias))
    outputs = generate(llm, logprobs=20, logit_bias=bias, **fields)
    penalized_count = sum(out.token_ids.count(42) for out in outputs)
    if min(fields.values()) > 0:
        assert penalized_count <= repeated
    if "frequency_penalty" in fields and "presence_penalty" not in fields:
        assert penalized_count < repeated  # it grows with every repeat
    for out in outputs:
        counts: dict[int, int] = {}

        def penalized(candidate, value, counts=counts):
            count = counts.get(candidate, 0)
            return (
                value
                + bias.get(candidate, 0.0)
                - fields.get("frequency_penalty", 0) * count
                - fields.get("presence_penalty", 0) * (count > 0)
            )

        for token, logprob in zip(out.token_ids, out.logprobs):
            best = max(penalized(candidate, value) for candidate, value in logprob.top)
            assert penalized(token, logprob.logprob) >= best - 1e-4  # raw logprobs + a shift = the logits
            counts[token] = counts.get(token, 0) + 1


def test_min_tokens_holds_back_stop_tokens_and_bad_words_never_appear(llms):
    llm, _ = llms
    plain = generate(llm)
    stop = plain[0].token_ids[1]
    stopped = generate(llm, stop_token_ids=[stop], ignore_eos=False)[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 2
    held = generate(llm, stop_token_ids=[stop], ignore_eos=False, min_tokens=6)[0]
    assert stop not in held.token_ids[:6] and len(held.token_ids) >= 6
    word = llm.tokenizer.decode(plain[1].token_ids[2:4]).strip()
    assert word
    cleaned = generate(llm, bad_words=[word])
    spellings = {tuple(llm.tokenizer.encode(text, add_special_tokens=False)) for text in (word, " " + word)}
    for out in cleaned:
        ids = out.token_ids
        assert not any(tuple(ids[i : i + len(s)]) == s for s in spellings for i in range(len(ids)))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize(
    "fields",
    [
        dict(logit_bias={11: 3.0, 12: -3.0}),
        dict(frequency_penalty=1.0),
        dict(repetition_penalty=1.8),
        dict(min_tokens=8, ignore_eos=False),
        dict(temperature=0.9, seed=3, min_p=0.2),
        dict(bad_words=["the", "a"]),
    ],
)
def test_a_cache_hit_changes_no_output_with_these_fields(llms, fields):
    cached, uncached = llms
    reference = [out.token_ids for out in generate(uncached, **fields)]
    assert [out.token_ids for out in generate(cached, **fields)] == reference
    again = generate(cached, **fields)
    assert [out.token_ids for out in again] == reference and again[0].num_cached_tokens > 0


def test_min_p_keeps_only_tokens_near_the_likeliest():
    from prefixserve.engine.sampling import sample_row

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {
        sample_row(logits, SamplingParams(temperature=1.0, min_p=0.5), torch.Generator().manual_seed(seed))
        for seed in range(200)
    }
    assert draws == {0, 1}  # 0.15 < 0.5 x 0.5: dropped


@pytest.mark.parametrize(
    "fields",
    [
        dict(frequency_penalty=1.5, logit_bias={42: 20.0}),
        dict(presence_penalty=2.0),
        dict(min_tokens=9, stop_token_ids=[42], logit_bias={42: 20.0}, ignore_eos=False),
        dict(bad_words=["the"], repetition_penalty=1.5),
    ],
)
def test_a_continued_stream_chooses_what_the_uninterrupted_one_would(llms, fields):
    """A router continues a stream elsewhere with prompt + the k tokens so far and continued_output_tokens=k
    (router/continuation.py): the penalties, min_tokens and bad_words count those k as output."""
    from prefixserve.router.continuation import ChoiceProgress, continuation_body
    from prefixserve.router.inbound import ClientRequest

    llm, _ = llms
    params = SamplingParams(**{**GREEDY, **fields})
    whole = llm.generate(PROMPTS[:1], params)[0]
    prompt = whole.prompt_token_ids
    for k in (3, 7):
        head = whole.token_ids[:k]
        progress = ChoiceProgress(prompt_token_ids=list(prompt), output_token_ids=list(head))
        sent = {
            **GREEDY,
            **fields,
            "logit_bias": {str(token): bias for token, bias in fields.get("logit_bias", {}).items()},
        }
        client = ClientRequest(
            path="/v1/completions",
            body=sent,
            streaming=True,
            n=1,
            num_choices=1,
            max_tokens=GREEDY["max_tokens"],
            wants_token_ids=False,
        )
        body = continuation_body(client, progress, include_usage=False)
        assert body["continued_output_tokens"] == k and body["prompt"] == prompt + head
        rest = SamplingParams(**{**GREEDY, **fields, "max_tokens": body["max_tokens"], "continued_output_tokens": k})
        tail = llm.generate([{"prompt_token_ids": body["prompt"]}], rest)[0]
        assert head + tail.token_ids == whole.token_ids
