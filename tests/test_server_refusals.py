"""What cannot be honoured is refused by name, on every API (found by a hostile probe): schemas that admit no
finite value, tools whose parameters are not a schema (under any tool_choice), limits, logit_bias keys,
/tokenize bodies, and Anthropic's own rules (cache_control, tool_result pairing, empty content, top_k)."""

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

CYCLES = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def post(server, path, body):
    return httpx.post(server.url + path, json={"model": "prefixserve-tiny", **body}, timeout=60)


@pytest.mark.parametrize("schema", CYCLES)
def test_a_schema_without_a_finite_value_is_refused_on_every_api(server, schema):
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    assert_openai_error(chat, 400, "response_format")
    assert "no finite JSON value" in chat.json()["error"]["message"]
    responses = post(
        server,
        "/v1/responses",
        {
            "input": "hi",
            "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
        },
    )
    assert responses.status_code == 400 and "no finite JSON value" in responses.text
    messages = post(
        server,
        "/v1/messages",
        {"messages": USER, "max_tokens": 8, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert messages.status_code == 400 and "no finite JSON value" in messages.text


def test_a_recursive_schema_with_a_way_out_is_served(server):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    }
    reply = post(
        server,
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    assert reply.status_code == 200


@pytest.mark.parametrize("choice", ["auto", "required", None])
def test_tool_parameters_that_are_not_a_schema_are_refused_whatever_the_choice(server, choice):
    extra = {} if choice is None else {"tool_choice": choice}
    responses = post(
        server,
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}], **extra},
    )
    assert_openai_error(responses, 400, "tools.0.parameters")
    messages = post(
        server,
        "/v1/messages",
        {"messages": USER, "max_tokens": 8, "tools": [{"name": "f", "input_schema": CYCLES[2]}]},
    )
    assert messages.status_code == 400 and "tools.0.input_schema" in messages.text


def test_limits_and_logit_bias_name_their_field(server):
    stops = post(server, "/v1/chat/completions", {"messages": USER, "stop": ["a"] * 10_000})
    assert_openai_error(stops, 422, "stop")
    assert "at most" in stops.json()["error"]["message"]
    outside = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logit_bias": {"99999999": 1}})
    assert_openai_error(outside, 400, "logit_bias")
    twice = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logit_bias": {"01": 1, "1": 2}})
    assert_openai_error(twice, 400, "logit_bias")


@pytest.mark.parametrize("body, param", [({}, "prompt"), ({"nothing": 1}, "prompt"), ({"prompt": 5}, "prompt")])
def test_a_bad_tokenize_body_says_what_it_expected(server, body, param):
    response = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert_openai_error(response, 422, param)
    assert "TokenizeChat" not in response.text


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "99h"}}]},
            "cache_control",
        ),
        ({"system": [{"type": "text", "text": "s", "cache_control": 5}]}, "cache_control"),
        (
            {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": 300}}]},
            "cache_control",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
            "tool_use_id",
        ),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_anthropic_refuses_as_anthropic_does(server, body, words):
    response = post(server, "/v1/messages", {"messages": USER, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and words in error["error"]["message"]


def test_anthropic_message_ids_start_msg_(server):
    reply = post(server, "/v1/messages", {"messages": USER, "max_tokens": 2})
    assert reply.json()["id"].startswith("msg_")
