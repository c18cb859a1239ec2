"""Structured output in the engine (engine/structured_output.py): every kind's output parses and validates,
whatever the model prefers; the mask wins over logit_bias; a grammar that does not compile is refused when
the params are made; a cache hit changes no output and the mask changes no cached block; a continued
stream's grammar starts past the tokens already produced."""

import json
import re

import jsonschema
import pytest
from conftest import make_llm

from prefixserve import SamplingParams, StructuredOutputs

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "colour", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
}
PROMPTS = ["Describe a person as JSON: ", "Sky, sea and grass. A person: ", "The weather today is"]
SPECS = {
    "json": StructuredOutputs(json=PERSON),
    "json text": StructuredOutputs(json=json.dumps(PERSON)),
    "choice": StructuredOutputs(choice=["yes", "no", "maybe later"]),
    "regex": StructuredOutputs(regex=r"(\d{3})-([a-z]{2,5})!"),
    "grammar": StructuredOutputs(grammar='start: "call " NAME "(" NUM ")"\nNAME: /[a-z]{1,8}/\nNUM: /[0-9]{1,3}/'),
}
# Long enough for every bounded output of SPECS; each ends when its grammar is complete.
PARAMS = dict(max_tokens=120, temperature=0.0)


def follows(kind, text):
    if kind.startswith("json"):
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):  # not JSON, or not of the schema
            return False
        return True
    if kind == "choice":
        return text in ("yes", "no", "maybe later")
    if kind == "regex":
        return re.fullmatch(r"\d{3}-[a-z]{2,5}!", text) is not None
    return re.fullmatch(r"call [a-z]{1,8}\([0-9]{1,3}\)", text) is not None


@pytest.fixture(scope="module")
def llms():
    return make_llm(), make_llm(enable_prefix_caching=False)


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.3, seed=5)])
def test_every_kind_of_output_parses_and_validates(llms, kind, sampling):
    llm, _ = llms
    params = SamplingParams(**{**PARAMS, **sampling}, structured_outputs=SPECS[kind])
    # batched beside an unconstrained request, which stays unconstrained
    outputs = llm.generate(PROMPTS + ["Free text:"], [params] * len(PROMPTS) + [SamplingParams(**PARAMS)])
    for output in outputs[:-1]:
        assert output.finish_reason == "stop" and follows(kind, output.text), output.text
    assert not follows(kind, outputs[-1].text)


def test_json_object_is_an_object_and_the_mask_wins_over_logit_bias(llms):
    llm, _ = llms
    opening = llm.engine.tokenizer.encode("[", add_special_tokens=False)[0]
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        structured_outputs=StructuredOutputs(json_object=True),
        logit_bias={opening: 100.0},
    )
    text = llm.generate(PROMPTS[:1], params)[0].text
    assert text.startswith("{") and opening not in llm.engine.tokenizer.encode(text[:1], add_special_tokens=False)


@pytest.mark.parametrize(
    "fields, phrase",
    [
        (dict(json={"type": "nope"}), "Invalid type"),
        (dict(json="{"), "does not parse"),
        (dict(regex="(("), "unclosed group"),
        (dict(grammar="start: nope"), "unknown name"),
        (dict(), "exactly one of"),
        (dict(regex="a", choice=["b"]), "exactly one of"),
        (dict(choice=[]), "choice must be"),
        (dict(choice="yes"), "choice must be"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_with_the_reason(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        StructuredOutputs(**fields)


def test_sampling_params_take_only_structured_outputs():
    with pytest.raises(ValueError, match="StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_a_cache_hit_changes_no_output_and_the_mask_no_cached_block(llms, kind):
    cached, uncached = llms
    params = SamplingParams(**PARAMS, structured_outputs=SPECS[kind])
    prompt = ["A shared system prompt that is long enough to fill several blocks of the cache. " * 3 + PROMPTS[0]]
    reference = uncached.generate(prompt, params)[0].token_ids
    first = cached.generate(prompt, params)[0]
    again = cached.generate(prompt, params)[0]
    assert first.token_ids == again.token_ids == reference and again.num_cached_tokens > 0
    # the same prompt unconstrained hits the blocks the constrained request cached: its prompt's K/V
    plain = cached.generate(prompt, SamplingParams(**PARAMS))[0]
    assert plain.num_cached_tokens == again.num_cached_tokens


def test_a_continued_stream_follows_the_grammar_from_where_it_stopped(llms):
    llm, _ = llms
    params = SamplingParams(**PARAMS, structured_outputs=SPECS["json"])
    whole = llm.generate(PROMPTS[:1], params)[0]
    for k in (1, 5):
        head = whole.token_ids[:k]
        rest = SamplingParams(**PARAMS, structured_outputs=SPECS["json"], continued_output_tokens=k)
        tail = llm.generate([{"prompt_token_ids": whole.prompt_token_ids + head}], rest)[0]
        assert head + tail.token_ids == whole.token_ids
    with pytest.raises(ValueError, match="continued output does not follow"):
        bad_head = llm.engine.tokenizer.encode("nope", add_special_tokens=False)
        llm.generate(
            [{"prompt_token_ids": whole.prompt_token_ids + bad_head}],
            SamplingParams(**PARAMS, structured_outputs=SPECS["json"], continued_output_tokens=len(bad_head)),
        )


def test_a_router_continuing_a_stream_carries_the_constraint():
    from prefixserve.router.continuation import ChoiceProgress, continuation_body
    from prefixserve.router.inbound import ClientRequest

    sent = {"prompt": "x", "max_tokens": 20, "response_format": {"type": "json_object"}, "guided_choice": ["a"]}
    client = ClientRequest(
        path="/v1/completions", body=sent, streaming=True, n=1, num_choices=1, max_tokens=20, wants_token_ids=False
    )
    body = continuation_body(client, ChoiceProgress(prompt_token_ids=[5, 6], output_token_ids=[7]), False)
    assert body["response_format"] == sent["response_format"] and body["guided_choice"] == ["a"]
    assert body["continued_output_tokens"] == 1
