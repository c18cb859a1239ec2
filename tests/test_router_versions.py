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
