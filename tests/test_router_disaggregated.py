"""Prefill/decode disaggregation over the shared tier (issue 28): one `--role prefill` replica and two `--role
decode` replicas behind the router, sharing a 3-master Redis Cluster (the first test, with a TTL on every record)
or one redis-server (the second). The prefill replica computes each prompt and writes its
KV to Redis before it answers; the decode replica the router picks fetches only the blocks it lacks and generates.
The text equals a whole replica's, whole or streamed; a dead prefill replica leaves the prompt to the decode
replica, with the same text."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import make_llm
from redis_helpers import redis_cluster  # noqa: F401 (the fixture)
from router_fleet import Fleet

from prefixserve import SamplingParams
from prefixserve.cache.scoping import compose_salt

pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")

SHARED = "A long shared instruction that every request of this tenant starts with, computed once. " * 8
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    response = httpx.post(
        url + "/v1/completions", timeout=120, json={"model": "prefixserve-tiny", "prompt": prompt, **GREEDY, **extra}
    )
    assert response.status_code == 200, response.text
    return response


def streamed_text(url: str, prompt: str) -> str:
    text = ""
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=120,
        json={"model": "prefixserve-tiny", "prompt": prompt, "stream": True, **GREEDY},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def prefills(fleet: Fleet, outcome: str) -> float:
    return fleet.router.metrics.prefills.labels(outcome)._value.get()


def record_ttls(cluster) -> list[int]:
    """The TTL in seconds of every KV record on every master of a cluster (-1: none)."""
    return [
        client.ttl(name)
        for server in cluster.masters()
        for client in [server.client()]
        for name in client.scan_iter(match=b"pskv:*")
    ]


def test_prefill_then_decode_moves_only_missing_blocks_and_keeps_the_text(redis_cluster, tier_secret_file):
    prompts = [SHARED + "First question: what is cached?", SHARED + "Second question: what moves?"]
    whole = make_llm()
    expected = [whole.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0] for prompt in prompts]
    args = (
        "--kv-remote-url",
        redis_cluster.url,
        "--kv-tier-secret-file",
        tier_secret_file,
        "--kv-fetch-policy",
        "always",
        "--kv-remote-ttl",
        "600",
    )
    with Fleet(3, replica_args=args, roles=["prefill", "decode", "decode"], kv_remote_url=redis_cluster.url) as fleet:
        answered = complete(fleet.url, prompts[0])
        first = answered.json()
        assert first["choices"][0]["text"] == expected[0].text
        assert prefills(fleet, "done") == 1
        details = first["usage"]["prompt_tokens_details"]
        full_blocks = (first["usage"]["prompt_tokens"] - 1) // 16
        # the decode replica had nothing: every full block of the prompt came over Redis, none computed twice
        assert details["cached_tokens_by_tier"]["remote"] == full_blocks * 16 == details["cached_tokens"]
        ttls = record_ttls(redis_cluster)  # the hand-off's records expire as every record of the tier does
        assert len(ttls) >= full_blocks and all(0 < ttl <= 600 for ttl in ttls), ttls
        second = complete(fleet.url, prompts[1])
        assert second.json()["choices"][0]["text"] == expected[1].text
        # the router sent it to the decode replica that holds the shared prefix: only the new blocks moved
        assert second.headers["x-prefixserve-replica"] == answered.headers["x-prefixserve-replica"]
        shared_blocks = len(whole.engine.tokenizer.encode(SHARED)) // 16
        moved = second.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] // 16
        new_blocks = (second.json()["usage"]["prompt_tokens"] - 1) // 16 - shared_blocks
        assert moved <= new_blocks + 1, (moved, new_blocks)
        assert (
            streamed_text(fleet.url, prompts[0] + " Again.")
            == whole.generate([prompts[0] + " Again."], SamplingParams(**GREEDY), use_tqdm=False)[0].text
        )
        fleet.kill(0)  # the prefill replica: the decode replicas compute the prompts themselves
        third = complete(fleet.url, SHARED + "Third question, with no prefill replica left.")
        assert (
            third.json()["choices"][0]["text"]
            == whole.generate(
                [SHARED + "Third question, with no prefill replica left."], SamplingParams(**GREEDY), use_tqdm=False
            )[0].text
        )
        assert prefills(fleet, "skipped") >= 1


def test_prefill_replicas_need_the_remote_tier():
    from prefixserve.router.settings import RouterSettings

    with pytest.raises(ValueError, match="--kv-remote-url"):
        RouterSettings(replicas=(), prefill_replicas=("http://127.0.0.1:9",), decode_replicas=("http://127.0.0.1:8",))
    with pytest.raises(ValueError, match="--max-prefill-queue-seconds"):
        RouterSettings(replicas=("http://127.0.0.1:8",), max_prefill_queue_seconds=-1.0)
    with pytest.raises(ValueError, match="--local-prefill-tokens"):
        RouterSettings(replicas=("http://127.0.0.1:8",), local_prefill_tokens=-1)
    with pytest.raises(ValueError, match="at least one --replica URL"):
        RouterSettings(replicas=(), prefill_replicas=("http://127.0.0.1:9",), kv_remote_url="redis://127.0.0.1:1")
    from prefixserve.config import EngineConfig

    with pytest.raises(ValueError, match="role 'prefill' hands KV over the fleet's remote tier"):
        EngineConfig(role="prefill")


def test_short_misses_prefill_on_the_decode_replica_and_tenants_stay_apart(redis_server, tier_secret_file, tmp_path):
    """--local-prefill-tokens: a prompt the decode replica mostly holds is prefilled there, not handed over; the
    router predicts that per tenant, so another tenant's identical prompt is a miss and goes through the prefill
    replica. Every text equals a whole replica's."""
    keys = {"key-acme": "acme", "key-beta": "beta"}
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(keys))
    whole = make_llm()
    prompts = [SHARED + "First question: what is cached?", SHARED + "Second question: what moves?"]
    expected = {p: whole.generate([p], SamplingParams(**GREEDY), use_tqdm=False)[0].text for p in prompts}
    args = (
        "--kv-remote-url",
        redis_server.url,
        "--kv-tier-secret-file",
        tier_secret_file,
        "--kv-fetch-policy",
        "always",
        "--api-keys-file",
        str(keys_file),
    )
    with Fleet(
        2,
        replica_args=args,
        roles=["prefill", "decode"],
        kv_remote_url=redis_server.url,
        api_keys=keys,
        local_prefill_tokens=48,
    ) as fleet:

        def ask(prompt: str, key: str) -> httpx.Response:
            return httpx.post(
                fleet.url + "/v1/completions",
                timeout=120,
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "prefixserve-tiny", "prompt": prompt, **GREEDY},
            )

        first = ask(prompts[0], "key-acme")
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected[prompts[0]]
        assert prefills(fleet, "done") == 1 and prefills(fleet, "local") == 0  # nothing held: handed over
        deadline = time.monotonic() + 10  # the router learns the decode replica's blocks from its KV events
        route = fleet.router.route_request(fleet.router.tokenizer.encode(prompts[1]), compose_salt("acme", None))
        while time.monotonic() < deadline and fleet.router.replicas[1].num_hit_blocks(route) == 0:
            time.sleep(0.05)
        second = ask(prompts[1], "key-acme")
        assert second.json()["choices"][0]["text"] == expected[prompts[1]]
        assert prefills(fleet, "local") == 1 and prefills(fleet, "done") == 1  # a short miss: prefilled there
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = ask(prompts[1], "key-beta")  # acme's blocks are not beta's: a whole miss, handed over
        assert other.json()["choices"][0]["text"] == expected[prompts[1]]
        assert prefills(fleet, "done") == 2 and prefills(fleet, "local") == 1
