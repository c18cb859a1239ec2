"""Hostile clients through the router to 3 real replicas (issue 9, items 3, 4, 5, 11): every fault is a
4xx with an OpenAI body, no request's fault ever takes a replica out, and a random-body fuzz leaves the
fleet healthy."""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import read_stream
from router_fleet import Fleet, down_counts, down_reasons_since

ROUTER_MAX_BYTES = 4 << 20
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def fleet(default_model_dir):
    with Fleet(3, max_request_bytes=ROUTER_MAX_BYTES) as running:
        yield running


def post_raw(fleet, path, raw: bytes, content_type="application/json", timeout=60):
    return httpx.post(fleet.url + path, content=raw, headers={"content-type": content_type}, timeout=timeout)


def assert_client_error(response):
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def legit(fleet):
    response = httpx.post(
        fleet.url + "/v1/completions", timeout=60, json={"prompt": "a fine request", "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200, response.text


HOSTILE_BODIES = {
    "text-part-int": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2},
    "text-part-null": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}], "max_tokens": 2},
    "text-part-object": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}],
        "max_tokens": 2,
    },
    "max-tokens-string": {"prompt": "hi", "max_tokens": "abc"},
    "max-tokens-list": {"prompt": "hi", "max_tokens": [1]},
    "max-tokens-bool": {"prompt": "hi", "max_tokens": True},
    "stream-yes": {"prompt": "hi", "max_tokens": 2, "stream": "yes"},
    "prompt-bools": {"prompt": [True, False], "max_tokens": 2},
    "seed-overflow": {"prompt": "hi", "max_tokens": 2, "seed": 1 << 80},
    "too-long-for-the-model": {"prompt": "hi", "max_tokens": 100000},
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_a_bad_body_is_a_4xx_answered_once_and_never_held_against_a_replica(fleet, name):
    before, routed = down_counts(fleet), sum(r.num_routed for r in fleet.router.replicas)
    for stream in (False, True):
        body = {**HOSTILE_BODIES[name], "stream": stream} if name != "stream-yes" else HOSTILE_BODIES[name]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert_client_error(httpx.post(fleet.url + path, json=body, timeout=60))
    assert sum(r.num_routed for r in fleet.router.replicas) - routed == 2  # not retried
    legit(fleet)
    assert down_reasons_since(fleet, before) == [[], [], []]


@pytest.mark.parametrize(
    "raw, content_type",
    [
        (b"[" * 1001 + b"]" * 1001, "application/json"),
        (b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", "application/json"),
        (b'{"prompt": "hi", "max_tokens": 1e400}', "application/json"),
        (b'{"prompt": "hi"', "application/json"),
        (b'{"prompt": "hi", "max_tokens": 2}', "text/plain"),
    ],
    ids=["nested-1001", "int-5000-digits", "max-tokens-1e400", "truncated", "text-plain"],
)
def test_unreadable_bodies_are_a_4xx_from_the_router_or_the_replica(fleet, raw, content_type):
    before = down_counts(fleet)
    for path in ENDPOINTS:
        assert_client_error(post_raw(fleet, path, raw, content_type))
    assert down_reasons_since(fleet, before) == [[], [], []]


def test_a_numerically_hostile_temperature_neither_fails_nor_spreads(fleet):
    before = down_counts(fleet)
    for temperature in (1e-300, 5e-324, 1e-38):
        for stream in (False, True):
            response = httpx.post(
                fleet.url + "/v1/completions",
                timeout=60,
                json={"prompt": "hi", "temperature": temperature, "max_tokens": 2, "stream": stream},
            )
            assert response.status_code < 500, response.text
            if stream and response.status_code == 200:
                events, done = read_stream(response)
                assert done and not [e for e in events if "error" in e]
    legit(fleet)
    assert all(r.healthy for r in fleet.router.replicas)
    assert down_reasons_since(fleet, before) == [[], [], []]


def test_a_big_body_is_refused_before_reading_and_a_big_prompt_stalls_nothing(fleet):
    before = down_counts(fleet)
    too_big = b'{"prompt": "' + b"x" * ROUTER_MAX_BYTES + b'"}'
    assert post_raw(fleet, "/v1/completions", too_big).status_code == 413
    # Under the router's limit but far past the model's context: routed by load without tokenizing,
    # and the replica refuses it; meanwhile the router keeps answering.
    big_prompt = json.dumps({"prompt": "lorem ipsum " * 300_000, "max_tokens": 2}).encode()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post_raw, fleet, "/v1/completions", big_prompt)
        while not pending.done():
            assert httpx.get(fleet.url + "/health", timeout=30).status_code == 200
            time.sleep(0.05)
        assert_client_error(pending.result())
    assert down_reasons_since(fleet, before) == [[], [], []]


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSON_VALUES,
            "content": st.text(max_size=20) | JSON_VALUES,
        }
    ),
    max_size=3,
)
BODIES = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 9000), max_size=6) | JSON_VALUES,
        "messages": MESSAGES | JSON_VALUES,
        "max_tokens": st.integers(-2, 3) | JSON_VALUES,
        "temperature": st.floats(0, 2) | JSON_VALUES,
        "top_p": st.floats(0, 1) | JSON_VALUES,
        "top_k": st.integers(-2, 50) | JSON_VALUES,
        "n": st.integers(0, 3) | JSON_VALUES,
        "seed": st.integers() | JSON_VALUES,
        "stream": st.booleans() | JSON_VALUES,
        "stop": st.text(max_size=3) | JSON_VALUES,
        "logprobs": st.booleans() | st.integers(-1, 3) | JSON_VALUES,
        "top_logprobs": st.integers(-1, 3) | JSON_VALUES,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON_VALUES,
        "return_token_ids": st.booleans() | JSON_VALUES,
        "cache_salt": st.text(max_size=5) | JSON_VALUES,
        "ignore_eos": st.booleans() | JSON_VALUES,
        "extra": JSON_VALUES,
    },
)
FUZZ_SECONDS = 40.0


def bounded(body: dict) -> dict:
    """Keep a valid request short: without max_tokens a replica fills its whole context."""
    body.setdefault("max_tokens", 3)
    value = body["max_tokens"]
    if isinstance(value, int) and not isinstance(value, bool) and value > 3:
        body["max_tokens"] = 3
    return body


def test_fuzzed_bodies_get_no_5xx_no_hang_and_leave_every_replica_healthy(fleet):
    before, deadline = down_counts(fleet), time.monotonic() + FUZZ_SECONDS

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        path=st.sampled_from(ENDPOINTS),
        payload=BODIES.map(lambda b: json.dumps(bounded(b)).encode()) | st.binary(max_size=64),
    )
    def throw(path, payload):
        if time.monotonic() > deadline:
            return
        response = post_raw(fleet, path, payload, timeout=60)
        assert response.status_code < 500, (payload[:300], response.status_code, response.text[:300])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        elif response.headers["content-type"].startswith("text/event-stream"):
            events, done = read_stream(response)
            assert done and not [e for e in events if "error" in e], (payload[:300], events[-1:])

    throw()
    legit(fleet)
    assert all(r.healthy for r in fleet.router.replicas)
    assert down_reasons_since(fleet, before) == [[], [], []]
