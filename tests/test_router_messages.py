"""Anthropic's Messages API through the router: placed by the tokens the replica will see, keys passed on, the
router's own errors in Anthropic's shape, and a stream replayed when its replica fails before the first event.

Fake replicas (tests/router_fakes.py) fail on cue, so each break is exact; the token ids and the SDK run
against a real replica.
"""

import json

import httpx
import pytest
from router_fakes import Failure, assert_only_down_for, fake_fleet, message_events, post, wait_until

from prefixserve.http_keys import Credentials
from prefixserve.model import Tokenizer
from prefixserve.router.inbound import read_request

BODY = {"model": "fake", "max_tokens": 6, "messages": [{"role": "user", "content": "tell me the greek letters"}]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def reference_events(tokenizer, fake) -> list[str]:
    prompt_ids = tokenizer.encode(BODY["messages"][-1]["content"])
    ids, _ = fake.reference(prompt_ids, BODY["max_tokens"])
    return message_events(tokenizer, ids, len(prompt_ids))


@pytest.mark.parametrize("how", ["reset", "truncate", "beats_then_stall"])
def test_a_stream_whose_replica_fails_before_its_first_event_is_replayed_whole(tokenizer, how):
    with fake_fleet(tokenizer, progress_timeout=1.0) as (url, fakes, router):
        fakes[0].failure = Failure(how, after_tokens=0)
        response = post(url, "/v1/messages", {**BODY, "stream": True})
        assert response.status_code == 200 and response.headers["x-prefixserve-replica"] == "replica-0"
        assert response.text == "".join(reference_events(tokenizer, fakes[1]))  # one whole stream, as replica-1's
        assert [path for path, _, _ in fakes[1].requests] == ["/v1/messages"]
        assert fakes[1].requests[0][1] == {**BODY, "stream": True}  # replayed as the client sent it


@pytest.mark.parametrize("how", ["reset", "truncate"])
def test_a_stream_that_fails_after_its_first_event_ends_with_anthropics_error_event(tokenizer, how):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure(how, after_tokens=4)
        response = post(url, "/v1/messages", {**BODY, "stream": True})
        sent, _, last = response.text.rpartition("event: error\n")
        assert sent == "".join(reference_events(tokenizer, fakes[1])[:4])  # what came, then the error event
        error = json.loads(last.removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        assert "cannot be continued" in error["error"]["message"]
        assert fakes[1].requests == []  # nothing replayed once the client had events


def test_beats_are_dropped_and_a_plain_message_moves_when_its_replica_resets(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("reset")
        response = post(url, "/v1/messages", BODY)
        assert response.status_code == 200 and response.headers["x-prefixserve-replica"] == "replica-1"
        assert (
            response.json()["content"][0]["text"]
            == fakes[1].reference(tokenizer.encode(BODY["messages"][-1]["content"]), 6)[1]
        )
        assert_only_down_for(router, {"replica-0"})


def test_the_routers_own_errors_on_messages_are_anthropics_body(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        bad = httpx.post(url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400
        assert bad.json()["type"] == "error" and bad.json()["error"]["type"] == "invalid_request_error"
        two_keys = httpx.post(url + "/v1/messages", json=BODY, headers=[("x-api-key", "a"), ("x-api-key", "b")])
        assert two_keys.status_code == 400 and two_keys.json()["error"]["type"] == "invalid_request_error"
        for fake in fakes:
            fake.engine_dead = True
        wait_until(lambda: not any(r.healthy for r in router.replicas))
        none = post(url, "/v1/messages", BODY)
        assert none.status_code == 503 and none.json()["error"]["type"] == "overloaded_error"
        # the OpenAI endpoints keep OpenAI's body
        assert post(url, "/v1/completions", {"prompt": "x"}).json()["error"]["code"] == "no_replica"


def test_x_api_key_reaches_the_replica_as_sent_and_picks_the_tenant(tokenizer):
    with fake_fleet(tokenizer, api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}) as (url, fakes, router):
        assert post(url, "/v1/messages", BODY, headers={"x-api-key": "key-a"}).status_code == 200
        assert fakes[0].api_keys == ["key-a"]
        # the same prompt under two keys: two scopes, so two sets of block keys
        routes = [
            router.route_request(
                tokenizer.encode("a prompt of a few blocks " * 8), router.tenant_of(Credentials(None, key))
            )
            for key in ("key-a", "key-b")
        ]
        assert routes[0].keys[0] != routes[1].keys[0]
        assert router.tenant_of(Credentials("Bearer key-b", None)) == "tenant-b"


def test_the_router_renders_a_messages_body_to_the_replicas_tokens(real_fleet):
    """System blocks, text, tool_use and tool_result, tools: the router's token ids equal the replica's count,
    so a Messages request is placed by the blocks the replica will compute."""
    url, router = real_fleet
    body = {
        "model": "prefixserve-tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools."}],
        "tools": [
            {
                "name": "get_weather",
                "description": "the weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "3 C"}]},
                    {"type": "text", "text": "And Paris?"},
                ],
            },
        ],
    }
    counted = httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert counted.status_code == 200
    request = read_request(json.dumps(body).encode(), "/v1/messages", router.tokenizer, 4096, 1 << 20)
    assert len(request.token_ids) == counted.json()["input_tokens"] > 0


def test_the_anthropic_client_through_the_router_reads_its_prefix_back(real_fleet):
    anthropic = pytest.importorskip("anthropic")
    url, router = real_fleet
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    system = [{"type": "text", "text": "You are a careful agent. " * 40, "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(
        model="prefixserve-tiny",
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": "What is a KV cache?"}],
    )
    with client.messages.stream(
        model="prefixserve-tiny",
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": "And a radix tree?"}],
    ) as stream:
        second = stream.get_final_message()
    # the system prompt's full blocks are read back
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 16 * ((first.usage.cache_creation_input_tokens - 15) // 16)
    assert second.usage.cache_read_input_tokens > 0
    counted = client.messages.count_tokens(
        model="prefixserve-tiny", system=system, messages=[{"role": "user", "content": "And a radix tree?"}]
    )
    usage = second.usage
    assert (
        counted.input_tokens == usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    )
    tokens = httpx.post(url + "/tokenize", json={"prompt": "hello there"}, timeout=30).json()["tokens"]
    assert (
        httpx.post(url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
        == "<|begin_of_text|>hello there"
    )  # the BOS /tokenize adds, as the replica answers it


@pytest.fixture(scope="module")
def real_fleet():
    """One real replica behind the router: what the SDK sees and what the replica counts (placement among
    several is the policies' tests' and rests on the token ids checked above)."""
    from router_fleet import Fleet

    with Fleet(1) as fleet:
        yield fleet.url, fleet.router
