"""Issue 9 against the live server: no request stops the engine, no tenant reads another's tokens,
hostile bodies get 4xx OpenAI errors, and a request that can never fit is refused, not spun on."""

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("hardening") / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    with LiveServer(
        "--api-keys-file",
        str(keys),
        "--admin-api-key",
        ADMIN,
        "--enable-kv-events",
        "--max-request-bytes",
        "1000000",
        "--max-waiting",
        "32",
    ) as live:
        yield live


def post(server, path, body, key="key-a", **kwargs):
    kwargs.setdefault("timeout", 60)
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers=headers, **kwargs)
    return httpx.post(server.url + path, json=body, headers=headers, **kwargs)


def assert_healthy(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ok = post(server, "/v1/completions", {"prompt": "still alive", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-38, 1e-6])
def test_tiny_temperatures_are_served_and_the_engine_lives(server, temperature):
    response = post(server, "/v1/completions", {"prompt": "hi", "temperature": temperature, "max_tokens": 2})
    assert response.status_code == 200, response.text
    greedy = post(server, "/v1/completions", {"prompt": "hi", "temperature": 0, "max_tokens": 2})
    assert response.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]  # below 1e-5: greedy
    assert_healthy(server)


def test_a_failing_step_fails_its_requests_alone(server):
    runner = server.engine.engine.runner
    original = runner.execute
    calls = []

    def broken(scheduled):
        runner.execute = original  # fail once
        calls.append(1)
        raise RuntimeError("simulated kernel failure")

    runner.execute = broken
    try:
        assert_openai_error(
            post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 2}), 500, code="request_failed"
        )
    finally:
        runner.execute = original
    assert calls == [1]
    assert_healthy(server)
    runner.execute = broken
    try:
        response = post(server, "/v1/completions", {"prompt": "boom", "max_tokens": 2, "stream": True})
    finally:
        runner.execute = original
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["code"] == "request_failed" and events[-1] == "[DONE]"
    assert_healthy(server)


# ----------------------------------------------------------------------------- admin-only endpoints
@pytest.mark.parametrize("path", ["/v1/kv_events", "/v1/cache/keys", "/v1/cache/info"])
def test_cache_endpoints_answer_the_admin_key_only(server, path):
    assert_openai_error(
        httpx.get(server.url + path, headers={"Authorization": "Bearer key-a"}, timeout=10), 403, code="admin_only"
    )
    assert_openai_error(httpx.get(server.url + path, timeout=10), 401)
    assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).status_code == 200


def test_kv_events_carry_no_token_ids(server):
    secret = "Tenant A's private plan: acquire the competitor in May. " * 4
    assert post(server, "/v1/completions", {"prompt": secret, "max_tokens": 1}).status_code == 200
    body = httpx.get(server.url + "/v1/kv_events", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    stored = [event for event in body["events"] if event["type"] == "BlockStored"]
    assert stored and all(event["token_ids"] == [] for event in stored)


def test_admin_endpoints_are_off_without_an_admin_key():
    with LiveServer("--enable-kv-events") as server:
        assert_openai_error(httpx.get(server.url + "/v1/kv_events", timeout=10), 404, code="admin_disabled")
        assert_openai_error(httpx.get(server.url + "/v1/cache/keys", timeout=10), 404, code="admin_disabled")


def test_kv_events_bad_cursor_is_an_openai_error(server):
    response = httpx.get(
        server.url + "/v1/kv_events?since=abc", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    assert_openai_error(response, 422, param="since")


# ----------------------------------------------------------------------------- hostile bodies
DEEP = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
HUGE_INT = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", DEEP, 400, None),
        ("/v1/completions", HUGE_INT, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 422, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            422,
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
            422,
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            400,  # the models served take text only: said so, not "should be a valid string"
            "messages.0.content.0.type",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, 422, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 422, "stream"),
        ("/v1/completions", {"prompt": [True, False]}, 422, None),
        ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 422, "temperature"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 422, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, 422, "seed"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 100_000}, 422, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 33}, 422, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * 257}, 422, "stop"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 422, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, 400, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 1, "extra": "y" * 10}, 200, None),
    ],
)
def test_hostile_bodies_get_4xx_openai_errors(server, path, body, status, param):
    response = post(server, path, body)
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        assert_openai_error(response, status, param)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_non_json_content_type_is_415(server):
    response = post(server, "/v1/completions", '{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert_openai_error(response, 415, code="unsupported_media_type")


def test_body_over_the_limit_is_413_before_it_is_read(server):
    big = json.dumps({"prompt": "y" * 1_200_000}).encode()
    assert_openai_error(post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(120):
            yield b" " * 10_000

    response = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        timeout=30,
        headers={"Authorization": "Bearer key-a", "Content-Type": "application/json"},
    )
    assert_openai_error(response, 413, code="request_too_large")
    assert_healthy(server)


def test_prompt_too_long_for_the_model_is_refused_without_blocking_health(server):
    async def run():
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer key-a"}) as client:
            big = client.post(server.url + "/v1/completions", json={"prompt": "word " * 39_000})
            health = client.get(server.url + "/health")
            return await asyncio.gather(big, health)

    big, health = asyncio.run(run())
    assert_openai_error(big, 413, code="context_length_exceeded")
    assert health.status_code == 200


def test_prompt_plus_max_tokens_over_max_model_len_is_400(server):
    max_model_len = server.engine.engine.max_model_len
    response = post(server, "/v1/completions", {"prompt": [5] * 100, "max_tokens": max_model_len})
    assert_openai_error(response, 400, param="max_tokens", code="context_length_exceeded")
    assert str(max_model_len) in response.json()["error"]["message"]


def test_batch_larger_than_the_queue_is_400_not_429(server):
    response = post(server, "/v1/completions", {"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 1})
    assert_openai_error(response, 400, code="batch_too_large")


def test_client_disconnect_leaves_no_unretrieved_future(server, caplog):
    """A plain request whose client goes away mid-generation: the socket closes once the engine has produced
    tokens for it (a condition, not a client timeout that a fast machine could outrun)."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    server.wait_idle()
    max_tokens = server.engine.engine.max_model_len - 8  # far more than can finish between two polls
    body = json.dumps({"prompt": "long", "max_tokens": max_tokens, "ignore_eos": True}).encode()
    generated = server.engine.snapshot.num_generation_tokens
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer key-a\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.monotonic() + 30
        while server.engine.snapshot.num_generation_tokens == generated and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.snapshot.num_generation_tokens > generated, "the request never started generating"
    server.wait_idle(timeout=30)
    assert server.engine.snapshot.num_generation_tokens - generated < max_tokens  # cut short by the disconnect
    assert not [record for record in caplog.records if "never retrieved" in record.getMessage()]
    assert server.engine.engine.cache.usage().num_referenced_blocks == 0


def test_metrics_are_a_consistent_snapshot_under_load(server):
    async def run():
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer key-b"}) as client:
            work = [
                client.post(
                    server.url + "/v1/completions", json={"prompt": f"load {i}", "max_tokens": 24, "ignore_eos": True}
                )
                for i in range(8)
            ]
            scrapes = []

            async def scrape():
                for _ in range(10):
                    answer = await client.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
                    scrapes.append(answer.text)
                    await asyncio.sleep(0.01)

            await asyncio.gather(*work, scrape())
            return scrapes

    from prometheus_client.parser import text_string_to_metric_families

    for text in asyncio.run(run()):
        values = {
            (s.name, s.labels.get("state")): s.value for f in text_string_to_metric_families(text) for s in f.samples
        }
        states = sum(values[("prefixserve:kv_blocks", state)] for state in ("free", "cached", "in_use"))
        assert states == values[("prefixserve:kv_blocks_total", None)]


# ----------------------------------------------------------------------------- logprobs
def test_chat_logprobs_have_openai_shape(server):
    response = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 3
        assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert bytes(entry["bytes"]).decode("utf-8", "replace") is not None
    assert "".join(entry["token"] for entry in content) == response.json()["choices"][0]["message"]["content"]


def test_completion_logprobs_streamed_equal_whole(server):
    body = {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert len(whole["tokens"]) == 5 and all(len(top) >= 2 for top in whole["top_logprobs"])
    assert whole["text_offset"][0] == 0
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    tokens, logprobs = [], []
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            piece = json.loads(line[6:])["choices"][0]["logprobs"]
            tokens += piece["tokens"]
            logprobs += piece["token_logprobs"]
    assert tokens == whole["tokens"] and logprobs == pytest.approx(whole["token_logprobs"])


def test_return_token_ids_streamed_and_whole(server):
    body = {
        "prompt": "Token ids please",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    assert len(whole["token_ids"]) == 6 and whole["prompt_token_ids"]
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert sum((chunk["token_ids"] for chunk in chunks), []) == whole["token_ids"]


# ------------------------------------------------------------ finite but hostile inputs (issue 24, items 4-6)
@pytest.mark.parametrize(
    "query",
    [
        "/dashboard/api/price?prompt_tokens=1e308",
        "/dashboard/api/ttl?ttls=1e308",
        "/dashboard/api/ttl?prefix_tokens=1e308",
        "/dashboard/api/capacity?sizes=" + "9" * 40,
    ],
)
def test_finite_inputs_that_would_overflow_are_a_400(server, query):
    response = httpx.get(server.url + query, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert_openai_error(response, 400, code="invalid_value")


def test_a_lone_surrogate_anywhere_in_a_body_is_invalid_json(server):
    for path, raw in (
        ("/v1/admin/reload", b'{"model": "\\ud800"}'),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "cache_salt": "\\udfff"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\uD800y"}]}'),
    ):
        key = ADMIN if "admin" in path else "key-a"
        response = httpx.post(
            server.url + path,
            content=raw,
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        assert_openai_error(response, 400, code="invalid_json")
    paired = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
        headers={"Authorization": "Bearer key-a", "content-type": "application/json"},
        timeout=60,
    )
    assert paired.status_code == 200  # a surrogate pair is a character


def test_two_authorization_headers_are_refused_and_raw_bytes_are_just_a_wrong_key(server):
    two = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        timeout=30,
        headers=[("authorization", "Bearer zz"), ("authorization", "Bearer key-a")],
    )
    assert_openai_error(two, 400, code="ambiguous_authorization")
    raw = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        timeout=30,
        headers=[(b"authorization", b"Bearer \xed\xa0\x80")],
    )
    assert_openai_error(raw, 401, code="invalid_api_key")
    assert_openai_error(
        httpx.get(server.url + "/v1/cache/keys", headers={"Authorization": "Bearer unknown"}, timeout=10),
        401,
        code="invalid_api_key",
    )  # neither a tenant's nor the admin's


def test_error_codes_are_the_readmes(server):
    not_object = httpx.post(
        server.url + "/v1/completions",
        content=b"[1, 2]",
        timeout=30,
        headers={"Authorization": "Bearer key-a", "content-type": "application/json"},
    )
    assert_openai_error(not_object, 400, code="invalid_json")
    assert_openai_error(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404, code="not_found")
    assert_openai_error(httpx.get(server.url + "/v1/completions", timeout=10), 405, code="method_not_allowed")


def test_control_endpoints_answer_while_a_step_runs(server):
    """/health, /v1/cache/info, /v1/cache/keys and /v1/kv_events answer from what the engine has published,
    never by waiting for its step: a router must not take a busy replica for a dead one (issue 24)."""
    import threading

    engine = server.engine.engine
    inside, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        inside.set()
        release.wait(60)  # a step far longer than any control timeout
        return real_step()

    engine.step = held_step
    try:
        waiting = threading.Thread(target=lambda: post(server, "/v1/completions", {"prompt": "busy", "max_tokens": 1}))
        waiting.start()
        assert inside.wait(30), "the request never reached a step"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for path in ("/health", "/v1/cache/info", "/v1/cache/keys", "/v1/kv_events?since=0"):
            response = httpx.get(server.url + path, headers=admin, timeout=5)
            assert response.status_code == 200, (path, response.text)
        assert not release.is_set()
    finally:
        engine.step = real_step
        release.set()
    waiting.join(60)
