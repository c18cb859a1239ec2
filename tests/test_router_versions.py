"""Routing by model version (issue 24): a request for 'name@fp_...' goes only to replicas of that version, as a
client pins the version a response's system_fingerprint named, across a rolling deploy."""

import httpx
import pytest
from router_fakes import fake_fleet, post

from prefixserve.model import Tokenizer

OLD, NEW = "a1" * 32, "b2" * 32


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def test_a_pinned_request_goes_only_to_replicas_of_its_version(tokenizer):
    with fake_fleet(tokenizer, num_replicas=3, fingerprints=[OLD, NEW, OLD]) as (url, fakes, router):
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["mixed"] and health["model_versions"] == {
            OLD[:12]: ["replica-0", "replica-2"],
            NEW[:12]: ["replica-1"],
        }
        for i in range(6):
            response = post(
                url, "/v1/completions", {"model": f"fake@fp_{NEW[:16]}", "prompt": f"p{i}", "max_tokens": 2}
            )
            assert response.status_code == 200 and response.headers["x-prefixserve-replica"] == "replica-1"
        for i in range(6):  # the digits alone, in any case, pin too
            response = post(
                url, "/v1/completions", {"model": f"fake@{OLD[:8].upper()}", "prompt": f"q{i}", "max_tokens": 2}
            )
            assert response.status_code == 200 and response.headers["x-prefixserve-replica"] in {
                "replica-0",
                "replica-2",
            }
        unpinned = post(url, "/v1/completions", {"model": "fake", "prompt": "r", "max_tokens": 2})
        assert unpinned.headers["x-prefixserve-replica"] == "replica-0"  # any version: the least loaded, first


def test_a_version_no_replica_serves_is_404_and_a_malformed_one_400(tokenizer):
    with fake_fleet(tokenizer, fingerprints=[OLD, OLD]) as (url, fakes, router):
        missing = post(
            url,
            "/v1/chat/completions",
            {"model": f"fake@fp_{NEW[:16]}", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and OLD[:12] in error["message"]
        for model in ("fake@", "fake@fp_12", "fake@not-hex"):
            malformed = post(url, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
            assert malformed.status_code == 400
            assert (malformed.json()["error"]["code"], malformed.json()["error"]["param"]) == ("invalid_value", "model")
        assert all(not fake.requests for fake in fakes)  # answered by the router, never forwarded


def test_a_pinned_stream_is_continued_only_on_its_version(tokenizer):
    from router_fakes import Failure, read_stream, texts_of

    with fake_fleet(tokenizer, num_replicas=3, fingerprints=[NEW, OLD, NEW]) as (url, fakes, router):
        fakes[0].failure = Failure("reset", after_tokens=2)
        response = post(
            url,
            "/v1/completions",
            {"model": f"fake@fp_{NEW[:16]}", "prompt": "letters", "max_tokens": 6, "stream": True},
        )
        events, done = read_stream(response)
        assert done and texts_of(events) == fakes[2].reference(tokenizer.encode("letters"), 6)[1]
        assert not fakes[1].requests


def test_a_continuation_is_pinned_to_the_version_the_stream_began_on():
    from prefixserve.router.continuation import pinned_model

    version = NEW[:16]
    assert pinned_model("fake", "fake", version) == f"fake@fp_{version}"
    assert pinned_model(None, "fake", version) == f"fake@fp_{version}"  # the name the stream's chunks carry
    assert pinned_model(f"fake@fp_{NEW[:8]}", "fake", version) == f"fake@fp_{version}"  # the longer pin
    assert pinned_model(f"fake@{NEW[:24].upper()}", "fake", version) == f"fake@fp_{NEW[:24]}"
    assert pinned_model(None, None, version) is None  # no name: the stream ends instead


@pytest.fixture
def stale_router(monkeypatch):
    """The router's own refresh of the replicas' versions (every SCOPE_REFRESH_SECONDS) never comes during the
    test: what it knows of a version is what it read at start, unless a continuation reads it again."""
    monkeypatch.setattr("prefixserve.router.fleet.SCOPE_REFRESH_SECONDS", 1e9)


def test_a_stream_is_not_continued_on_a_replica_reloaded_since_the_router_read_it(tokenizer, stale_router):
    """Issue 56: replica-1 is reloaded to another version and replica-0, serving a stream, dies before the router
    refreshes: the router reads replica-1's version again before continuing there, and ends the stream instead."""
    from router_fakes import Failure, read_stream, texts_of

    with fake_fleet(tokenizer, fingerprints=[OLD, OLD]) as (url, fakes, router):
        fakes[1].model_fingerprint = NEW  # reloaded; the router still says OLD
        assert router.replicas[1].model_fingerprint == OLD
        fakes[0].failure = Failure("reset", after_tokens=3)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 8, "stream": True})
        events, done = read_stream(response)
        assert done and events[-1]["error"]["code"] == "stream_interrupted"
        assert f"fp_{OLD[:16]}" in events[-1]["error"]["message"]
        reference = fakes[0].reference(tokenizer.encode("letters"), 3)[1]
        assert texts_of(events[:-1]) == reference  # the old version's text up to the break, nothing after
        assert {e["system_fingerprint"] for e in events[:-1]} == {f"fp_{OLD[:16]}"}
        assert fakes[1].requests == []  # never asked to continue it
        assert router.replicas[1].model_fingerprint == NEW  # read right before


def test_a_replica_reloaded_between_the_read_and_the_request_refuses_the_pinned_continuation(tokenizer, stale_router):
    """A reload that lands after the router read replica-1's version but before the continuation reached it:
    replica-1 refuses the pinned body (404 model_not_found, as the server's check inside its reload gate does),
    and the stream goes on at replica-2, which still serves the version it began on."""
    from router_fakes import Failure, read_stream, texts_of

    with fake_fleet(tokenizer, num_replicas=3, fingerprints=[OLD, OLD, OLD]) as (url, fakes, router):
        fakes[1].reload_after_info = NEW
        fakes[0].failure = Failure("reset", after_tokens=3)
        response = post(url, "/v1/completions", {"model": "fake", "prompt": "letters", "max_tokens": 8, "stream": True})
        events, done = read_stream(response)
        assert done and texts_of(events) == fakes[2].reference(tokenizer.encode("letters"), 8)[1]
        pinned = f"fake@fp_{OLD[:16]}"
        assert [body["model"] for _, body, _ in fakes[1].requests] == [pinned]  # asked, and it refused
        assert [body["model"] for _, body, _ in fakes[2].requests] == [pinned]
        assert router.metrics.continued.labels("replica-2")._value.get() == 1
        assert router.metrics.continued.labels("replica-1")._value.get() == 0


@pytest.mark.parametrize("other_replica", ["same_version", "older_version"])
def test_the_version_a_stream_began_on_is_the_one_its_chunks_name(tokenizer, stale_router, other_replica):
    """replica-0 was reloaded before the stream began and the router has not read it since: the stream's chunks
    (system_fingerprint) say which version began it, not the router's record. It goes on only where that version
    is served now."""
    from router_fakes import Failure, read_stream, texts_of

    with fake_fleet(tokenizer, fingerprints=[OLD, OLD]) as (url, fakes, router):
        fakes[0].model_fingerprint = NEW
        if other_replica == "same_version":
            fakes[1].model_fingerprint = NEW
        assert [r.model_fingerprint for r in router.replicas] == [OLD, OLD]
        fakes[0].failure = Failure("reset", after_tokens=3)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 8, "stream": True})
        events, done = read_stream(response)
        assert done
        if other_replica == "same_version":
            assert texts_of(events) == fakes[1].reference(tokenizer.encode("letters"), 8)[1]
            assert [body["model"] for _, body, _ in fakes[1].requests] == [f"fake@fp_{NEW[:16]}"]
        else:
            assert events[-1]["error"]["code"] == "stream_interrupted" and fakes[1].requests == []
        assert {e["system_fingerprint"] for e in events if "error" not in e} == {f"fp_{NEW[:16]}"}


def test_a_stream_whose_chunks_name_no_version_is_not_continued(tokenizer):
    from router_fakes import Failure, read_stream

    with fake_fleet(tokenizer, fingerprints=["not-a-version", "not-a-version"]) as (url, fakes, router):
        fakes[0].failure = Failure("reset", after_tokens=3)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 8, "stream": True})
        events, done = read_stream(response)
        assert done and events[-1]["error"]["code"] == "stream_interrupted"
        assert "system_fingerprint" in events[-1]["error"]["message"] and fakes[1].requests == []
