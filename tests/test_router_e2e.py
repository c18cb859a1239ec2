"""Router + 3 real replicas (subprocesses) on localhost: prefix affinity, tenant scopes, failover, streams
continued after their replica is killed (issue 9, item 10)."""

import json
import re

import httpx
import pytest
from router_fakes import read_stream
from router_fleet import ADMIN_KEY, Fleet, down_counts, down_reasons_since, index_of

from prefixserve.cache.scoping import compose_salt

SYSTEM = "You are the fleet's test assistant; the fleet shares this long instruction block. " * 8
KEYS = {"key-acme": "acme", "key-beta": "beta"}
ACME = {"authorization": "Bearer key-acme"}


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    with Fleet(3, replica_args=("--api-keys-file", str(keys_file)), api_keys=KEYS) as running:
        yield running


def chat(url, question, max_tokens=4):
    response = httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        headers=ACME,
        json={
            "model": "prefixserve-tiny",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        },
    )
    assert response.status_code == 200, response.text
    return response


def test_requests_sharing_a_prefix_land_where_it_is_cached(fleet):
    first = chat(fleet.url, "Question zero?")
    home = first.headers["x-prefixserve-replica"]
    assert re.fullmatch(r"replica-\d", home)  # a name, never the replica's URL
    for i in range(1, 5):
        response = chat(fleet.url, f"Question {i}?")
        assert response.headers["x-prefixserve-replica"] == home
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    streamed = httpx.post(
        fleet.url + "/v1/completions",
        timeout=60,
        headers=ACME,
        json={"prompt": "stream through the router", "max_tokens": 4, "stream": True},
    )
    events, done = read_stream(streamed)
    assert streamed.status_code == 200 and done
    assert all("token_ids" not in c and "prompt_token_ids" not in c for e in events for c in e["choices"])
    metrics = httpx.get(fleet.url + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    assert 'prefixserve_router:routed_requests_total{replica="replica-' in metrics
    assert "prefixserve_router:predicted_hit_tokens_total" in metrics and "127.0.0.1" not in metrics


def test_router_keys_a_tenants_prompt_exactly_as_the_replica_does(fleet):
    prompt = "Tenant acme's private preamble, long enough to fill several blocks of sixteen tokens. " * 4
    response = httpx.post(
        fleet.url + "/v1/completions",
        timeout=60,
        headers=ACME,
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert response.status_code == 200
    replica = fleet.router.replicas[index_of(fleet, response.headers["x-prefixserve-replica"])]
    stored = set(
        httpx.get(replica.url + "/v1/cache/keys", timeout=10, headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()[
            "keys"
        ]
    )
    token_ids = fleet.router.tokenizer.encode(prompt)
    expected = fleet.router.route_request(token_ids, compose_salt("acme", None)).keys
    assert len(expected) >= 4 and {key.hex() for key in expected} <= stored
    other_tenant = fleet.router.route_request(token_ids, compose_salt("beta", None)).keys
    assert not {key.hex() for key in other_tenant} & stored
    # A tenant key may not read the cache's keys; the router uses the admin key for that.
    assert httpx.get(replica.url + "/v1/cache/keys", headers=ACME, timeout=10).status_code == 403


def test_killing_a_replica_mid_run_loses_no_request(fleet):
    import asyncio

    router, before = fleet.router, down_counts(fleet)
    prompts = [f"Independent prompt number {i} about something else entirely. " * 3 for i in range(12)]

    async def run():
        async with httpx.AsyncClient(timeout=180, headers=ACME) as client:

            async def one(prompt):
                return await client.post(
                    fleet.url + "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True},
                )

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            for _ in range(200):  # until requests are under way (bounded: 10 s)
                if sum(len(r.outstanding) for r in router.replicas) >= 6:
                    break
                await asyncio.sleep(0.05)
            busiest = max(range(3), key=lambda i: len(router.replicas[i].outstanding))
            # the kill must land on requests in flight, or the test proves nothing about failover
            assert len(router.replicas[busiest].outstanding) >= 2, [len(r.outstanding) for r in router.replicas]
            fleet.kill(busiest)
            return busiest, await asyncio.gather(*tasks)

    busiest, responses = asyncio.run(run())
    try:
        assert [r.status_code for r in responses] == [200] * 12
        assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses)
        assert not router.replicas[busiest].healthy
        reasons = down_reasons_since(fleet, before)
        assert reasons[busiest] and all(
            r.startswith(("transport failure", "health check failed")) for r in reasons[busiest]
        )
        assert [r for i, r in enumerate(reasons) if i != busiest] == [[], []]
    finally:
        fleet.restart(busiest)
        fleet.wait_all_healthy()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_whose_replica_is_killed_finishes_elsewhere_with_the_same_text(fleet, path):
    router, before = fleet.router, down_counts(fleet)
    body = {"max_tokens": 160, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"A long answer please ({path})"}]
    else:
        body["prompt"] = f"Write a long story ({path})"
    reference = httpx.post(fleet.url + path, json=body, headers=ACME, timeout=120).json()
    expected = reference["choices"][0].get("text") or reference["choices"][0]["message"]["content"]
    chunks, victim, in_flight = [], None, False
    with httpx.stream("POST", fleet.url + path, json={**body, "stream": True}, headers=ACME, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            chunks.append(line[6:])
            if len(chunks) == 3:  # under way: kill the replica serving it
                victim = index_of(fleet, response.headers["x-prefixserve-replica"])
                in_flight = bool(router.replicas[victim].outstanding)
                fleet.kill(victim)
    try:
        assert chunks[-1] == "[DONE]"
        events = [json.loads(c) for c in chunks[:-1]]
        assert not [e for e in events if "error" in e]
        text = "".join(c.get("text") or c.get("delta", {}).get("content", "") for e in events for c in e["choices"])
        assert text == expected
        assert len({e["id"] for e in events}) == 1
        assert events[-1]["usage"]["completion_tokens"] == 160
        assert events[-1]["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        if in_flight:
            continued = sum(router.metrics.continued.labels(r.name)._value.get() for r in router.replicas)
            assert continued >= 1
        assert [r for i, r in enumerate(down_reasons_since(fleet, before)) if i != victim] == [[], []]
    finally:
        fleet.restart(victim)
        fleet.wait_all_healthy()


def test_a_stream_on_a_replica_that_hangs_finishes_elsewhere_before_it_wakes(fleet):
    """SIGSTOP, not a kill: the connection stays open and no error ever comes. The progress deadline moves
    the stream to another replica, which finishes it with the reference text while the first still sleeps."""
    import os
    import signal

    body = {"prompt": "Tell a long tale of a hung replica", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    expected = httpx.post(fleet.url + "/v1/completions", json=body, headers=ACME, timeout=120).json()
    expected = expected["choices"][0]["text"]
    chunks, victim = [], None
    try:
        with httpx.stream(
            "POST", fleet.url + "/v1/completions", json={**body, "stream": True}, headers=ACME, timeout=120
        ) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:])
                if len(chunks) == 3:
                    victim = index_of(fleet, response.headers["x-prefixserve-replica"])
                    os.kill(fleet.processes[victim].pid, signal.SIGSTOP)
        assert victim is not None and fleet.processes[victim].poll() is None  # still stopped, not dead
        events = [json.loads(c) for c in chunks[:-1]]
        assert chunks[-1] == "[DONE]" and not [e for e in events if "error" in e]
        assert "".join(c["text"] for e in events for c in e["choices"]) == expected
    finally:
        if victim is not None:
            os.kill(fleet.processes[victim].pid, signal.SIGCONT)
        fleet.wait_all_healthy()
