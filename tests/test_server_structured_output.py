"""Structured output over HTTP: OpenAI's response_format (json_object, json_schema) through the official
client, vLLM's structured_outputs and guided_* fields, streamed too; asking twice, a schema that does not
compile or a backend we do not have is a 400 naming the field."""

import json

import httpx
import jsonschema
import pytest
from server_helpers import LiveServer, assert_openai_error, openai_client

ANSWER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["answer", "confidence"],
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
}
MESSAGES = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_json_schema_through_the_openai_client_parses_and_validates(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for temperature in (0.0, 1.2):
        reply = client.chat.completions.create(
            model="prefixserve-tiny",
            messages=MESSAGES,
            max_tokens=40,
            temperature=temperature,
            seed=1,
            response_format=response_format,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_json_object_streams_an_object(client):
    stream = client.chat.completions.create(
        model="prefixserve-tiny",
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.startswith("{")  # the built-in model may run out of tokens inside a string; it starts an object


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("structured_outputs", {"regex": "[0-9]{2}-[a-z]{3}"}, lambda text: len(text) == 6 and text[2] == "-"),
        ("structured_outputs", {"choice": ["left", "right"]}, lambda text: text in ("left", "right")),
        ("guided_choice", ["up", "down"], lambda text: text in ("up", "down")),
        ("guided_json", ANSWER, lambda text: jsonschema.validate(json.loads(text), ANSWER) is None),
        ("guided_regex", "(ab|cd){2}", lambda text: text in ("abab", "abcd", "cdab", "cdcd")),
        ("guided_grammar", 'start: "f(" /[0-9]/ ")"', lambda text: len(text) == 4 and text.startswith("f(")),
    ],
)
def test_vllm_fields_constrain_completions(server, field, value, check):
    body = {"prompt": "Answer:", "max_tokens": 40, "temperature": 0, field: value}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ],
)
def test_a_constraint_that_cannot_be_followed_is_a_400_naming_the_field(server, fields, param):
    response = httpx.post(
        server.url + "/v1/chat/completions", timeout=30, json={"messages": MESSAGES, "max_tokens": 4, **fields}
    )
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"json": {}, "structural_tag": "x"}},
        {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_a_field_we_do_not_have_is_refused_not_ignored(server, fields):
    response = httpx.post(server.url + "/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 4, **fields})
    assert 400 <= response.status_code < 500 and "error" in response.json(), response.text


def test_the_constraint_leaves_the_prompt_cache_alone(server, client):
    system = [{"role": "system", "content": "A long shared system prompt for the cache. " * 12}]
    messages = system + [{"role": "user", "content": "Yes or no?"}]
    plain = client.chat.completions.create(model="prefixserve-tiny", messages=messages, max_tokens=4, temperature=0)
    constrained = client.chat.completions.create(
        model="prefixserve-tiny",
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert constrained.choices[0].message.content in ("yes", "no")
    cached = constrained.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached >= plain.usage.prompt_tokens_details.cached_tokens
