"""Random bodies at both endpoints for a bounded number of examples: never a 5xx, never a hang,
and the engine healthy afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer

SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SMALL_COUNTS = st.integers(1, 3)


def field(valid):
    """A field's value: mostly something plausible, sometimes anything at all."""
    return st.one_of(valid, ANY_JSON)


PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(-5, 9000), min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "user", "assistant", "tool", "wizard"])),
        "content": field(st.text(max_size=30) | st.just([{"type": "text", "text": "hi"}])),
    }
)
COMMON = {
    "max_tokens": field(SMALL_COUNTS),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0, 1)),
    "top_k": field(st.integers(-2, 50)),
    "seed": field(st.integers(-(2**65), 2**65)),
    "n": field(SMALL_COUNTS),
    "stop": field(st.lists(st.text(max_size=5), max_size=3)),
    "stream": field(st.booleans()),
    "logprobs": field(st.integers(0, 3) | st.booleans()),
    "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(st.lists(st.integers(-1, 9000), max_size=3)),
    "cache_salt": field(st.text(max_size=5)),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "return_token_ids": field(st.booleans()),
    "echo": field(st.booleans()),
}


def bodies(required: dict):
    return st.fixed_dictionaries(required, optional=COMMON)


COMPLETION_BODIES = bodies({"prompt": field(PROMPTS)})
CHAT_BODIES = bodies(
    {"messages": field(st.lists(MESSAGE, min_size=0, max_size=3)), "top_logprobs": field(st.integers(0, 3))}
)


@pytest.fixture(scope="module")
def server():
    with LiveServer("--max-model-len", "64") as live:
        yield live


def send(server, path, body) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    response = httpx.post(server.url + path, content=raw, timeout=60, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzz_completions(server, body):
    send(server, "/v1/completions", body)


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat(server, body):
    send(server, "/v1/chat/completions", body)


@FUZZ
@given(raw=st.binary(max_size=200) | ANY_JSON.map(lambda value: json.dumps(value).encode()))
def test_fuzz_raw_bytes(server, raw):
    send(server, "/v1/completions", raw)


def test_engine_healthy_after_fuzzing(server):
    server.wait_idle(timeout=60)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "ok?", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200
