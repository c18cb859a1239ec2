"""Two replicas sharing one redis-server (then a Redis Cluster), the router in front: a prefix computed on one
replica is served to a request routed to the other from the remote tier, with identical greedy text."""

import time

import httpx
import pytest
from router_fleet import Fleet

SYSTEM = "You are the fleet's shared assistant; this long instruction block is computed once. " * 12


def chat(url, question):
    response = httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "prefixserve-tiny",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        },
    )
    assert response.status_code == 200, response.text
    return response


def wait_for_records(shared, at_least: int, timeout: float = 60.0) -> int:
    """Until the first replica's background writes reached Redis, every master of a cluster counted (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = shared.num_keys()
        if count >= at_least:
            return count
        time.sleep(0.05)
    raise AssertionError(f"only {shared.num_keys()} records reached Redis in {timeout} s")


def test_a_prefix_computed_on_one_replica_is_served_to_another(shared_redis, tier_secret_file):
    pytest.importorskip("redis")
    # every remote hit fetched: the default planner may recompute a short run on a machine that reads slowly
    with Fleet(
        2,
        replica_args=(
            "--kv-remote-url",
            shared_redis.url,
            "--kv-tier-secret-file",
            tier_secret_file,
            "--kv-fetch-policy",
            "always",
        ),
        policy="round_robin",
    ) as fleet:
        first = chat(fleet.url, "Which replica computed this?")
        usage = first.json()["usage"]
        full_blocks = (usage["prompt_tokens"] - 1) // 16
        wait_for_records(shared_redis, full_blocks)
        second = chat(fleet.url, "Which replica computed this?")  # round robin: the other replica
        assert second.headers["x-prefixserve-replica"] != first.headers["x-prefixserve-replica"]
        details = second.json()["usage"]["prompt_tokens_details"]
        assert details["cached_tokens_by_tier"]["remote"] == full_blocks * 16 == details["cached_tokens"]
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
