"""The router tells a replica's failure from a request's fault, and answers every hostile body itself.

Against fake replicas (tests/router_fakes.py): a 5xx response is relayed, never
retried or held against the replica; only transport failures move a request, to
at most --max-attempts distinct replicas; bodies the router cannot read get an
OpenAI-style 4xx; admin and tenant keys go where they belong; clients and metrics
see replica names, never URLs; the router's idle loops stay quiet in the log.
"""

import asyncio
import json
import logging

import httpx
import pytest
from router_fakes import ADMIN_KEY, Failure, assert_only_down_for, fake_fleet, post, wait_until

from prefixserve.model import Tokenizer
from prefixserve.router.inbound import read_request
from prefixserve.router.route_launch import add_route_arguments, configure_logging, settings_from_args

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def assert_openai_error(response, status):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert set(response.json()["error"]) == OPENAI_ERROR_KEYS


def test_a_5xx_answer_is_relayed_not_retried_and_the_replica_stays_up(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("status_500")
        for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
            response = post(url, "/v1/completions", body)
            assert_openai_error(response, 500)
            assert response.headers["x-prefixserve-replica"] == "replica-0"
        assert len(fakes[0].requests) == 2 and fakes[1].requests == []
        checks = [fake.num_health_checks for fake in fakes]  # 3 more: a whole round began and ended after the 5xx
        wait_until(lambda: all(fake.num_health_checks >= count + 3 for fake, count in zip(fakes, checks)))
        assert all(r.healthy for r in router.replicas)
        assert_only_down_for(router, set())


def test_a_transport_failure_moves_the_request_and_records_why(tokenizer):
    with fake_fleet(tokenizer, names=["east", "west"]) as (url, fakes, router):
        fakes[0].failure = Failure("reset")
        response = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200 and response.headers["x-prefixserve-replica"] == "west"
        reason = router.replicas[0].down_reasons[-1].reason  # a reset before the headers or while reading the body
        assert reason.startswith("transport failure") and "on /v1/completions" in reason
        assert_only_down_for(router, {"east"})


def test_retries_stop_after_max_attempts_distinct_replicas(tokenizer):
    with fake_fleet(tokenizer, 4, max_attempts=3) as (url, fakes, router):
        for fake in fakes:
            fake.failure = Failure("reset")
        response = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert_openai_error(response, 502)
        assert sorted(len(fake.requests) for fake in fakes) == [0, 1, 1, 1]


@pytest.mark.parametrize(
    "raw, content_type, status",
    [
        (b'{"prompt": "hi", "max_tokens": ', "application/json", 400),
        (b"[" * 1001 + b"]" * 1001, "application/json", 400),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", 400),
        (b'["a list"]', "application/json", 400),
        (b"\xff\xfe not utf-8", "application/json", 400),
        (b'{"prompt": "hi"}', "text/plain", 415),
        (b'{"prompt": "' + b"x" * 9000 + b'"}', "application/json", 413),
    ],
    ids=["truncated", "nested-1001", "int-5000-digits", "not-an-object", "not-utf8", "text-plain", "too-large"],
)
def test_bodies_the_router_cannot_forward_get_an_openai_4xx(tokenizer, raw, content_type, status):
    with fake_fleet(tokenizer, 1, max_request_bytes=8192) as (url, fakes, router):
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = httpx.post(url + path, content=raw, headers={"content-type": content_type}, timeout=30)
            assert_openai_error(response, status)
        assert fakes[0].requests == []


@pytest.mark.parametrize("max_tokens", ["abc", [1], 1e400, True, None, -3, 10**30, {"a": 1}])
def test_odd_max_tokens_are_forwarded_for_the_replica_to_judge(tokenizer, max_tokens):
    with fake_fleet(tokenizer, 1) as (url, fakes, router):
        for stream in (False, True):
            literal = "1e400" if max_tokens == 1e400 else json.dumps(max_tokens)  # 1e400 reads back as inf
            raw = '{"prompt": "hi", "stream": %s, "max_tokens": %s}' % (json.dumps(stream), literal)
            response = httpx.post(
                url + "/v1/completions", content=raw.encode(), headers={"content-type": "application/json"}, timeout=30
            )
            assert response.status_code in (200, 422), response.text
        assert len(fakes[0].requests) == 2


def test_an_unexpected_router_error_is_an_openai_500_body(tokenizer, monkeypatch):
    with fake_fleet(tokenizer, 1) as (url, fakes, router):

        def broken(*args):
            raise RuntimeError("a router bug")

        monkeypatch.setattr(router, "route_request", broken)
        response = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert_openai_error(response, 500)
        assert "a router bug" not in response.text


def test_control_calls_carry_the_admin_key_and_client_calls_the_tenants(tokenizer, tmp_path):
    with fake_fleet(tokenizer, 1, api_keys={"tenant-key": "acme"}) as (url, fakes, router):
        wait_until(
            lambda: (
                {"/v1/cache/info", "/v1/kv_events"} <= {path for path, _ in fakes[0].control_auth}
                and router.replicas[0].can_mirror
            ),
            timeout=30,
        )  # the first polls have run
        response = post(
            url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"authorization": "Bearer tenant-key"}
        )
        assert response.status_code == 200
        paths = {path for path, _ in fakes[0].control_auth}
        assert {"/v1/cache/info", "/v1/kv_events"} <= paths
        assert {auth for _, auth in fakes[0].control_auth} == {f"Bearer {ADMIN_KEY}"}
        assert [auth for _, _, auth in fakes[0].requests] == ["Bearer tenant-key"]
        assert router.replicas[0].can_mirror


def test_clients_and_metrics_see_replica_names_never_urls(tokenizer):
    with fake_fleet(tokenizer, names=["gpu-a", "gpu-b"]) as (url, fakes, router):
        response = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert response.headers["x-prefixserve-replica"] == "gpu-a"
        assert httpx.get(url + "/health").json()["healthy_replicas"] == ["gpu-a", "gpu-b"]
        metrics = httpx.get(url + "/metrics").text
        assert 'replica="gpu-a"' in metrics and "127.0.0.1" not in metrics


def test_replica_flags_take_optional_names_and_bad_ones_say_how_to_fix_them(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)

    def settings(*argv):
        return settings_from_args(parser.parse_args(list(argv)))

    named = settings(
        "--replica",
        "gpu-a=http://10.0.0.5:8000",
        "--replica",
        "http://10.0.0.6:8000/",
        "--admin-api-key",
        "k",
        "--max-request-bytes",
        "1000",
        "--max-attempts",
        "2",
    )
    assert named.named_replicas() == [("gpu-a", "http://10.0.0.5:8000"), ("replica-1", "http://10.0.0.6:8000")]
    assert (named.admin_api_key, named.max_request_bytes, named.max_attempts) == ("k", 1000, 2)
    for argv, hint in [
        (["--replica", "bad name=http://x:1"], "use letters"),
        (["--replica", "a=http://x:1", "--replica", "a=http://y:1"], "appears twice"),
        (["--replica", "10.0.0.5:8000"], "base URL"),
    ]:
        with pytest.raises(SystemExit, match=hint):
            settings(*argv)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "acme", "k2": "acme\u0000eu"}))
    with pytest.raises(SystemExit, match="printable"):
        settings("--replica", "http://x:1", "--api-keys-file", str(keys))


def test_routing_tokenizes_off_the_event_loop_and_skips_absurd_prompts(tokenizer):
    with fake_fleet(tokenizer, 1) as (url, fakes, router):
        threads, encode = [], router.tokenizer.encode

        def recording_encode(text, *args, **kwargs):
            try:  # an event loop runs in this thread only if it is the loop's own (uvloop's workers, too, have none)
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            threads.append((on_loop, len(text)))
            return encode(text, *args, **kwargs)

        router.tokenizer.encode = recording_encode
        assert post(url, "/v1/completions", {"prompt": "a short prompt", "max_tokens": 2}).status_code == 200
        assert (
            post(url, "/v1/completions", {"prompt": "x" * (router.max_prompt_chars + 1), "max_tokens": 2}).status_code
            == 200
        )
        assert [length for _, length in threads] == [len("a short prompt")]  # the long one was never tokenized
        assert threads[0][0] is False  # a to_thread worker, not the event loop's thread
    request = read_request(b'{"prompt": "' + b"y" * 1000 + b'"}', "/v1/completions", tokenizer, 100, 999)
    assert request.token_ids == []


def test_idle_health_checks_and_event_polls_log_nothing(tokenizer, caplog):
    previous = logging.getLogger("httpx").level
    try:
        configure_logging("info")
        with fake_fleet(tokenizer, health_interval=0.02, sync_interval=0.02) as (url, fakes, router):
            caplog.clear()
            with caplog.at_level(logging.INFO):
                start = len(fakes[0].control_auth)
                wait_until(lambda: len(fakes[0].control_auth) >= start + 10, timeout=30)  # ten more control polls
        noisy = [r for r in caplog.records if r.name in ("httpx", "prefixserve.router")]
        assert noisy == [], [r.getMessage() for r in noisy]
    finally:
        logging.getLogger("httpx").setLevel(previous)


def test_busy_is_not_down_but_a_replica_that_stops_answering_is():
    """A slow answer is a busy replica (a control call waits for the engine's step; a long step can hold
    up /health): a sync that times out keeps it up with its mirror, and /health must time out
    `health_failure_threshold` times in a row before it goes down. A refused connection takes it out at
    once, and any answer resets the count."""
    import asyncio

    from prefixserve.router.replicas import Replica

    behaviour = {"health": "ok", "sync": "ok"}

    def handler(request: httpx.Request) -> httpx.Response:
        kind = "health" if request.url.path == "/health" else "sync"
        if behaviour[kind] == "slow":
            raise httpx.ReadTimeout("timed out", request=request)
        if behaviour[kind] == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if kind == "health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json={"keys": [b"k".hex()], "tiers": {}, "next": 1})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            replica = Replica("http://replica", "busy", health_failure_threshold=3)
            await replica.check_health(client, 1.0)
            await replica.sync(client, {}, 1.0)
            assert replica.healthy and replica.mirror.keys == {b"k"}
            behaviour.update(health="slow", sync="slow")
            for _ in range(2):
                await replica.check_health(client, 1.0)
                await replica.sync(client, {}, 1.0)
            assert replica.healthy and replica.mirror.keys == {b"k"} and not replica.down_reasons
            behaviour["health"] = "ok"  # an answer between slow ones starts the count over
            await replica.check_health(client, 1.0)
            behaviour["health"] = "slow"
            for _ in range(2):
                await replica.check_health(client, 1.0)
            assert replica.healthy
            await replica.check_health(client, 1.0)
            assert not replica.healthy and "timed out 3 times in a row" in replica.down_reasons[-1].reason
            behaviour.update(health="ok", sync="ok")
            await replica.check_health(client, 1.0)
            assert replica.healthy
            behaviour["health"] = "refused"
            await replica.check_health(client, 1.0)
            assert not replica.healthy and "refused" in replica.down_reasons[-1].reason
            behaviour.update(health="ok", sync="refused")
            await replica.check_health(client, 1.0)
            await replica.sync(client, {}, 1.0)
            assert not replica.healthy and replica.down_reasons[-1].reason.startswith("transport failure during")

    asyncio.run(run())


def test_the_health_failure_threshold_is_a_route_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    settings = settings_from_args(
        parser.parse_args(["--replica", "http://127.0.0.1:1", "--health-failure-threshold", "5"])
    )
    assert settings.health_failure_threshold == 5
    with pytest.raises(SystemExit, match="at least 1"):
        settings_from_args(parser.parse_args(["--replica", "http://127.0.0.1:1", "--health-failure-threshold", "0"]))


def test_hostile_headers_and_surrogates_are_answered_by_the_router_with_a_4xx(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        surrogate = httpx.post(
            url + "/v1/completions",
            content=b'{"prompt": "hi", "cache_salt": "\\ud800"}',
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert_openai_error(surrogate, 400)
        assert surrogate.json()["error"]["code"] == "invalid_json"
        two = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            timeout=30,
            headers=[("authorization", "Bearer zz"), ("authorization", "Bearer ka")],
        )
        assert_openai_error(two, 400)
        assert two.json()["error"]["code"] == "ambiguous_authorization"
        assert fakes[0].requests == [] and fakes[1].requests == []  # neither reached a replica
        raw = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            timeout=30,
            headers=[(b"authorization", b"Bearer \xed\xa0\x80")],
        )
        assert raw.status_code < 500, raw.text
        forwarded = fakes[0].requests[-1][2]
        assert forwarded.encode("latin-1") == b"Bearer \xed\xa0\x80"  # byte for byte
        not_object = httpx.post(
            url + "/v1/completions", content=b'"hi"', headers={"content-type": "application/json"}, timeout=30
        )
        assert not_object.status_code == 400 and not_object.json()["error"]["code"] == "invalid_json"
        assert_only_down_for(router, set())


def test_a_snapshot_taken_before_a_request_was_stored_keeps_its_routed_keys():
    """The router counts a routed request's keys as cached at once; a key snapshot that the replica took
    before storing them (it was in flight while the request ran) must not erase them, or the next request of
    the same prefix is sent elsewhere. A replica marked down forgets them."""
    import asyncio

    import httpx

    from prefixserve.router.replicas import Replica

    def snapshot(request):
        return httpx.Response(200, json={"keys": ["00" * 8], "next": 5})

    async def run():
        replica = Replica("http://replica")
        replica.healthy = True
        replica.expect([b"\x01" * 8, b"\x02" * 8])
        async with httpx.AsyncClient(transport=httpx.MockTransport(snapshot)) as client:
            await replica.sync(client, {}, timeout=1.0)
        kept = set(replica.mirror.keys)
        replica.mark_down("test")
        replica.mark_up()
        async with httpx.AsyncClient(transport=httpx.MockTransport(snapshot)) as client:
            await replica.sync(client, {}, timeout=1.0)
        return kept, set(replica.mirror.keys), replica.cursor

    kept, after_down, cursor = asyncio.run(run())
    assert kept == {b"\x00" * 8, b"\x01" * 8, b"\x02" * 8}
    assert after_down == {b"\x00" * 8} and cursor == 5
