"""Prefill/decode disaggregation over the shared tier (issue 28): one `--role prefill` replica and two `--role
decode` replicas behind the router, sharing a redis-server. The prefill replica computes each prompt and writes its
KV to Redis before it answers; the decode replica the router picks fetches only the blocks it lacks and generates.
The text equals a whole replica's, whole or streamed; a dead prefill replica leaves the prompt to the decode
replica, with the same text."""

from __future__ import annotations

import json

import httpx
import pytest

from prefixserve import SamplingParams

from conftest import make_llm
from router_fleet import Fleet

pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")

SHARED = "A long shared instruction that every request of this tenant starts with, computed once. " * 8
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    response = httpx.post(url + "/v1/completions", timeout=120,
                          json={"model": "prefixserve-tiny", "prompt": prompt, **GREEDY, **extra})
    assert response.status_code == 200, response.text
    return response


def streamed_text(url: str, prompt: str) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": "prefixserve-tiny", "prompt": prompt, "stream": True, **GREEDY}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def prefills(fleet: Fleet, outcome: str) -> float:
    return fleet.router.metrics.prefills.labels(outcome)._value.get()


def test_prefill_then_decode_moves_only_missing_blocks_and_keeps_the_text(redis_server, tier_secret_file):
    prompts = [SHARED + "First question: what is cached?", SHARED + "Second question: what moves?"]
    whole = make_llm()
    expected = [whole.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0] for prompt in prompts]
    args = ("--kv-remote-url", redis_server.url, "--kv-tier-secret-file", tier_secret_file, "--kv-fetch-policy",
            "always")
    with Fleet(3, replica_args=args, roles=["prefill", "decode", "decode"], kv_remote_url=redis_server.url) as fleet:
        answered = complete(fleet.url, prompts[0])
        first = answered.json()
        assert first["choices"][0]["text"] == expected[0].text
        assert prefills(fleet, "done") == 1
        details = first["usage"]["prompt_tokens_details"]
        full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16
        # the decode replica had nothing: every full block of the prompt came over Redis, none computed twice
        assert details["cached_tokens_by_tier"]["remote"] == full_blocks * 16 == details["cached_tokens"]
        second = complete(fleet.url, prompts[1])
        assert second.json()["choices"][0]["text"] == expected[1].text
        # the router sent it to the decode replica that holds the shared prefix: only the new blocks moved
        assert second.headers["x-prefixserve-replica"] == answered.headers["x-prefixserve-replica"]
        shared_blocks = len(whole.engine.tokenizer.encode(SHARED)) // 16
        moved = second.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] // 16
        new_blocks = (second.json()["usage"]["prompt_tokens"] - 1) // 16 - shared_blocks
        assert moved <= new_blocks + 1, (moved, new_blocks)
        assert streamed_text(fleet.url, prompts[0] + " Again.") == whole.generate(
            [prompts[0] + " Again."], SamplingParams(**GREEDY), use_tqdm=False)[0].text
        fleet.kill(0)  # the prefill replica: the decode replicas compute the prompts themselves
        third = complete(fleet.url, SHARED + "Third question, with no prefill replica left.")
        assert third.json()["choices"][0]["text"] == whole.generate(
            [SHARED + "Third question, with no prefill replica left."], SamplingParams(**GREEDY),
            use_tqdm=False)[0].text
        assert prefills(fleet, "skipped") >= 1


def test_prefill_replicas_need_the_remote_tier():
    from prefixserve.router.settings import RouterSettings

    with pytest.raises(ValueError, match="--kv-remote-url"):
        RouterSettings(replicas=(), prefill_replicas=("http://127.0.0.1:9",), decode_replicas=("http://127.0.0.1:8",))
    with pytest.raises(ValueError, match="at least one --replica URL"):
        RouterSettings(replicas=(), prefill_replicas=("http://127.0.0.1:9",), kv_remote_url="redis://127.0.0.1:1")
    from prefixserve.config import EngineConfig

    with pytest.raises(ValueError, match="role 'prefill' hands KV over the fleet's remote tier"):
        EngineConfig(role="prefill")
