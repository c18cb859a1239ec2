"""Anthropic's Messages API through the official anthropic client: usage splits the prompt into cache reads,
cache writes and the rest as Anthropic defines them; a cache_control breakpoint pins its prefix for its TTL and a
later hit pushes the expiry out; tool use (forced and streamed) and tool results; count_tokens; x-api-key maps to
tenants; errors in Anthropic's body."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from server_helpers import LiveServer

KEY, ADMIN = "tenant-key", "admin-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    },
}
SYSTEM_TEXT = "You are an agent with tools; be brief. " * 30


def system(ttl="5m"):
    return [{"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral", "ttl": ttl}}]


@pytest.fixture(scope="module")
def server():
    # One tenant pins every breakpoint here: its pins may take the whole cap (the default share is a quarter).
    with LiveServer("--api-key", KEY, "--admin-api-key", ADMIN, "--tenant-pin-share", "1") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def create(client, **fields):
    fields = {"model": "prefixserve-tiny", "max_tokens": 12, "extra_body": {"temperature": 0.0}, **fields}
    return client.messages.create(**fields)


def pins(server):
    response = httpx.get(server.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    return response.json()["data"]


def test_usage_reads_what_the_breakpoint_wrote(server, client):
    messages = [{"role": "user", "content": "Hello there"}]
    total = client.messages.count_tokens(model="prefixserve-tiny", system=system(), messages=messages).input_tokens
    first = create(client, system=system(), messages=messages).usage
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert first.input_tokens + first.cache_creation_input_tokens + first.cache_read_input_tokens == total
    second = create(client, system=system(), messages=messages).usage
    assert second.cache_creation_input_tokens == 0
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens // 16 * 16
    assert second.input_tokens + second.cache_read_input_tokens == total


def test_a_breakpoint_pins_its_prefix_for_its_ttl_and_a_hit_extends_it(server, client):
    text = "A second system prompt, kept for an hour. " * 20
    blocks = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    before = {pin["id"] for pin in pins(server)}
    create(client, system=blocks, messages=[{"role": "user", "content": "One"}])
    new = [pin for pin in pins(server) if pin["id"] not in before]
    assert len(new) == 1 and new[0]["expires_at"] - new[0]["created_at"] == pytest.approx(3600, abs=60)
    create(client, system=blocks, messages=[{"role": "user", "content": "Two"}])
    again = [pin for pin in pins(server) if pin["id"] == new[0]["id"]]
    assert len(again) == 1 and again[0]["expires_at"] >= new[0]["expires_at"]  # the same pin, pushed out
    assert len(pins(server)) == len(before) + 1


def test_forced_tool_use_whole_and_streamed(client):
    fields = dict(
        system=system(),
        tools=[WEATHER],
        tool_choice={"type": "any"},
        max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    whole = create(client, **fields)
    assert whole.stop_reason == "tool_use"
    use = whole.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(model="prefixserve-tiny", extra_body={"temperature": 0.0}, **fields) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content
    ]
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_result_continues_from_the_cache(client):
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    first = create(
        client,
        system=system(),
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=40,
        messages=question,
    )
    use = first.content[-1]
    turn = question + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C"}]},
    ]
    second = create(client, system=system(), tools=[WEATHER], messages=turn)
    first_prompt = (
        first.usage.input_tokens + first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    )
    assert second.usage.cache_read_input_tokens >= first_prompt // 16 * 16


def test_a_stop_sequence_is_reported(client):
    plain = create(client, messages=[{"role": "user", "content": "Count"}], max_tokens=8).content[0].text
    stop = plain[3:6]
    reply = create(client, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
        [{"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(5)],
    ],
)
def test_what_cannot_be_served_is_an_anthropic_400(client, content):
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(client, messages=[{"role": "user", "content": content}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"


def test_x_api_key_maps_to_a_tenant_and_a_wrong_key_is_refused(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="prefixserve-tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    both = httpx.post(
        server.url + "/v1/messages",
        timeout=30,
        headers={"x-api-key": KEY, "Authorization": "Bearer other"},
        json={"model": "prefixserve-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    )
    assert both.status_code == 400 and json.loads(both.text)["type"] == "error"
    openai_style = httpx.post(
        server.url + "/v1/completions", headers={"x-api-key": KEY}, timeout=30, json={"prompt": "x", "max_tokens": 2}
    )
    assert openai_style.status_code == 200


def test_output_config_format_gives_json_that_follows_the_schema(client):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["ok"],
        "properties": {"ok": {"type": "boolean"}},
    }
    reply = create(
        client,
        max_tokens=20,
        messages=[{"role": "user", "content": "Reply in JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_top_level_cache_control_marks_the_last_block(server, client):
    before = {pin["id"] for pin in pins(server)}
    messages = [{"role": "user", "content": "Automatic caching of this whole conversation, please. " * 8}]
    first = create(client, messages=messages, cache_control={"type": "ephemeral"})
    assert first.usage.cache_creation_input_tokens > 0 and first.usage.input_tokens <= 16
    assert len([pin for pin in pins(server) if pin["id"] not in before]) == 1


@pytest.mark.parametrize(
    "fields", [{"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"output_config": {"effort": "high"}}]
)
def test_features_not_served_are_refused_not_ignored(client, fields):
    with pytest.raises(anthropic.BadRequestError):
        create(client, messages=[{"role": "user", "content": "x"}], **fields)
