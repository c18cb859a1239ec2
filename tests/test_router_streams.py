"""Streams through the router survive a dying replica: continued elsewhere, or ended with an error event.

Runs against fake replicas (tests/router_fakes.py) that die on cue mid-stream, so
every break happens at an exact token and every expectation is exact.
"""

import httpx
import pytest
from router_fakes import (
    FAKE_FINGERPRINT,
    Failure,
    assert_only_down_for,
    fake_fleet,
    post,
    read_stream,
    texts_of,
    wait_until,
)

from prefixserve.model import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("how", ["reset", "truncate", "engine_dead"])
def test_a_completion_stream_continues_on_another_replica_with_the_same_text(tokenizer, how):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure(how, after_tokens=5)
        prompt_ids = tokenizer.encode("tell me the greek letters")
        reference_ids, reference_text = fakes[1].reference(prompt_ids, 12, seed=7)
        response = post(
            url,
            "/v1/completions",
            {
                "prompt": "tell me the greek letters",
                "max_tokens": 12,
                "seed": 7,
                "temperature": 0.8,
                "top_k": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert response.status_code == 200
        assert response.headers["x-prefixserve-replica"] == "replica-0"
        events, done = read_stream(response)
        assert done
        assert texts_of(events) == reference_text
        assert {e["id"] for e in events} == {events[0]["id"]} and {e["created"] for e in events} == {1001}
        assert all("token_ids" not in c and "prompt_token_ids" not in c for e in events for c in e["choices"])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 12,
            "total_tokens": len(prompt_ids) + 12,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        # The continuation: original prompt + the 5 ids already sent, 7 tokens to go, same sampling fields.
        [(path, body, _)] = fakes[1].requests
        assert path == "/v1/completions"
        assert body["prompt"] == prompt_ids + reference_ids[:5]
        assert (body["max_tokens"], body["seed"], body["temperature"], body["top_k"]) == (7, 7, 0.8, 5)
        assert body["stream"] is True and body["return_token_ids"] is True
        if how == "engine_dead":  # the health check, not the error event, takes it out
            wait_until(lambda: not router.replicas[0].healthy)
            assert "503" in router.replicas[0].down_reasons[-1].reason
        if how == "reset":
            assert "transport failure" in router.replicas[0].down_reasons[-1].reason
        assert_only_down_for(router, {"replica-0"})


def test_a_chat_stream_continues_as_chat_chunks_and_keeps_token_ids_the_client_asked_for(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("reset", after_tokens=3)
        messages = [{"role": "user", "content": "and the letters?"}]
        prompt_ids = tokenizer.encode_chat(messages)
        reference_ids, reference_text = fakes[1].reference(prompt_ids, 9)
        response = post(
            url,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 9, "stream": True, "return_token_ids": True},
        )
        events, done = read_stream(response)
        assert done and texts_of(events, chat=True) == reference_text
        assert {e["object"] for e in events} == {"chat.completion.chunk"}
        assert len({e["id"] for e in events}) == 1
        assert [c["delta"].get("role") for e in events for c in e["choices"]].count("assistant") == 1
        assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == reference_ids
        assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
        assert fakes[1].requests[0][0] == "/v1/completions"


def test_a_stop_string_across_the_break_ends_the_stream_where_an_unbroken_one_would(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        prompt_ids = tokenizer.encode("letters")
        _, full_text = fakes[1].reference(prompt_ids, 20)
        fakes[0].failure = Failure("reset", after_tokens=4)
        sent_before_break = tokenizer.decode(fakes[1].reference(prompt_ids, 4)[0])
        stop = full_text[len(sent_before_break) - 2 : len(sent_before_break) + 3]  # straddles the break
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 20, "stop": [stop], "stream": True})
        events, done = read_stream(response)
        assert done and texts_of(events) == full_text[: full_text.index(stop)]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_nothing_sent_yet_replays_the_original_request(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("reset", after_tokens=0)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 6, "stream": True})
        events, done = read_stream(response)
        assert done and texts_of(events) == fakes[1].reference(tokenizer.encode("letters"), 6)[1]
        assert fakes[1].requests[0][1]["prompt"] == "letters"
        assert "model" not in fakes[1].requests[0][1]  # nothing of a version reached the client: any version goes


def test_the_requests_own_failure_is_relayed_not_retried(tokenizer):
    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("request_failed", after_tokens=2)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 6, "stream": True})
        events, done = read_stream(response)
        assert done and events[-1]["error"]["code"] == "request_failed"
        assert fakes[1].requests == []
        assert_only_down_for(router, set())


@pytest.mark.parametrize("case", ["n_2", "no_other_replica", "attempts_exhausted"])
def test_a_stream_that_cannot_continue_ends_with_an_error_event(tokenizer, case):
    num_replicas = 1 if case == "no_other_replica" else 2
    options = {"max_attempts": 1} if case == "attempts_exhausted" else {}
    with fake_fleet(tokenizer, num_replicas, **options) as (url, fakes, router):
        fakes[0].failure = Failure("reset", after_tokens=2)
        response = post(
            url,
            "/v1/completions",
            {"prompt": "letters", "max_tokens": 6, "stream": True, "n": 2 if case == "n_2" else 1},
        )
        events, done = read_stream(response)
        assert done and set(events[-1]["error"]) == {"message", "type", "param", "code"}
        assert events[-1]["error"]["code"] == {"n_2": "stream_interrupted"}.get(case, "no_replica")
        assert len(texts_of(events[:-1])) > 0
        if num_replicas == 2:
            assert fakes[1].requests == []


def test_a_stream_is_continued_only_on_a_replica_of_the_same_model_version(tokenizer):
    """A rolling deploy: replica-1 restarts on another checkpoint under the same name. A stream broken on
    replica-0 is not stitched onto it: it ends with an error event; /health reports the mixed fleet.
    Once replica-1 serves replica-0's version again, the same break is continued there."""

    def restart_on(fake, replica, fingerprint):
        """Down (its /health answers 503, as while it restarts), then up on `fingerprint`: the router reads
        the version of a replica that came back up before it trusts it."""
        fake.engine_dead = True
        wait_until(lambda: not replica.healthy)
        fake.model_fingerprint, fake.engine_dead = fingerprint, False
        wait_until(lambda: replica.healthy and replica.model_fingerprint == fingerprint)

    with fake_fleet(tokenizer) as (url, fakes, router):
        other = "07e4" * 16
        restart_on(fakes[1], router.replicas[1], other)
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["mixed"] and sorted(health["model_versions"]) == sorted([FAKE_FINGERPRINT[:12], other[:12]])
        fakes[0].failure = Failure("reset", after_tokens=2)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 6, "stream": True})
        events, done = read_stream(response)
        assert done and events[-1]["error"]["code"] == "stream_interrupted"
        assert "model version" in events[-1]["error"]["message"]
        assert [path for path, _, _ in fakes[1].requests] == []  # never asked to continue it
        restart_on(fakes[1], router.replicas[1], FAKE_FINGERPRINT)
        assert not httpx.get(url + "/health", timeout=10).json()["mixed"]
        wait_until(lambda: router.replicas[0].healthy)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 6, "stream": True})
        events, done = read_stream(response)
        assert done and texts_of(events) == fakes[1].reference(tokenizer.encode("letters"), 6)[1]
        assert {e["system_fingerprint"] for e in events} == {"fp_" + FAKE_FINGERPRINT[:16]}  # the continued chunks too
        assert fakes[1].requests[-1][1]["model"] == "fake@fp_" + FAKE_FINGERPRINT[:16]  # pinned to that version


def test_a_stream_that_stops_making_progress_is_continued_elsewhere_with_the_same_text(tokenizer):
    """A replica that hangs mid-stream (no transport error: the connection stays open) is caught by the
    progress deadline: the stream continues on the other replica from the tokens already sent."""
    with fake_fleet(tokenizer, progress_timeout=0.5) as (url, fakes, router):
        fakes[0].failure = Failure("stall", after_tokens=3)
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 8, "stream": True})
        events, done = read_stream(response)
        assert done and texts_of(events) == fakes[1].reference(tokenizer.encode("letters"), 8)[1]
        assert "no progress" in router.replicas[0].down_reasons[-1].reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_replica_stops_beating_moves_after_the_progress_deadline(tokenizer, stream):
    """A replica sends progress beats while it steps, so silence before the first token (or, for a plain
    request, before its whole answer) is a hang: past the deadline the request is retried on another replica
    and answers with that replica's text; the silent one is marked down with the reason."""
    with fake_fleet(tokenizer, progress_timeout=0.5) as (url, fakes, router):
        fakes[0].failure = Failure("beats_then_stall")
        response = post(url, "/v1/completions", {"prompt": "letters", "max_tokens": 6, "stream": stream})
        assert response.status_code == 200, response.text
        expected = fakes[1].reference(tokenizer.encode("letters"), 6)[1]
        if stream:
            events, done = read_stream(response)
            assert done and texts_of(events) == expected
        else:
            assert response.json()["choices"][0]["text"] == expected
            assert response.headers["x-prefixserve-replica"] == "replica-1"
        assert "no progress for 0.5 s" in router.replicas[0].down_reasons[-1].reason
        assert fakes[1].requests[-1][1].get("stream", False) is stream  # the request itself, retried whole


def test_a_replica_marked_down_releases_the_plain_requests_waiting_on_it(tokenizer):
    """From a replica that sends no progress beats (an older server), a plain request waits for its whole
    answer, so no deadline can tell a long one from a hung one; the health checks can. When they mark the
    replica down, the request moves at once."""
    import threading

    with fake_fleet(tokenizer) as (url, fakes, router):
        fakes[0].failure = Failure("stall_plain")
        result = []
        thread = threading.Thread(
            target=lambda: result.append(post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3}))
        )
        thread.start()
        wait_until(lambda: len(fakes[0].requests) == 1)
        fakes[0].engine_dead = True  # its /health fails: the router marks it down, on its own loop
        thread.join(30)
        assert result and result[0].status_code == 200
        assert result[0].headers["x-prefixserve-replica"] == "replica-1"


def test_a_continued_streams_usage_keeps_the_cached_tokens_by_tier():
    from prefixserve.router.continuation import ChoiceProgress, usage_of

    progress = ChoiceProgress()
    progress.prompt_token_ids = list(range(100))
    progress.output_token_ids = list(range(7))
    reported = {
        "prompt_tokens_details": {
            "cached_tokens": 104,
            "cached_tokens_by_tier": {"device": 64, "host": 0, "disk": 40, "remote": 0},
        }
    }  # the continuation's longer prompt
    details = usage_of([progress], 1, reported)["prompt_tokens_details"]
    assert details == {
        "cached_tokens": 100,
        "cached_tokens_by_tier": {"device": 64, "host": 0, "disk": 36, "remote": 0},
    }
    assert usage_of([progress], 1, {"prompt_tokens_details": {"cached_tokens": 3}})["prompt_tokens_details"] == {
        "cached_tokens": 3
    }
