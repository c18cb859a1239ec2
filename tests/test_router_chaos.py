"""Chaos through the router (issue 9): 3 real replicas, a bounded stream of good and hostile requests, one
replica SIGKILLed mid-run and restarted on its port. Every good request, streams included, completes with
the text of a reference computed up front, and no replica is marked down for a request's fault."""

import asyncio
import itertools
import json

import httpx
import pytest
from router_fleet import Fleet, down_counts, down_reasons_since, index_of

SHARED = "A preamble that several of the good requests share, so routing has prefixes to follow. " * 3
NUM_GOOD = 12
MAX_HOSTILE = 400  # bound on the hostile requests sent while the good ones run
RUN_TIMEOUT = 120.0


def good_requests() -> list[tuple[str, dict]]:
    requests = []
    for i in range(NUM_GOOD):
        body = {"max_tokens": (48, 96, 64)[i % 3], "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        prefix = SHARED if i % 4 < 2 else ""
        if i % 3 == 0:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"{prefix}Request {i}?"}]
        else:
            path, body["prompt"] = "/v1/completions", f"{prefix}Request number {i} continues"
        requests.append((path, body))
    return requests


HOSTILE = [
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2}
        ).encode(),
        "application/json",
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": "hi", "temperature": 1e-300, "max_tokens": 2}).encode(),
        "application/json",
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": "hi", "temperature": 5e-324, "max_tokens": 2, "stream": True}).encode(),
        "application/json",
    ),
    ("/v1/completions", b"[" * 1001 + b"]" * 1001, "application/json"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "application/json"),
    ("/v1/chat/completions", b'{"messages": "x", "max_tokens": "abc"}', "application/json"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 100000}).encode(), "application/json"),
    ("/v1/completions", b'{"prompt": "hi"}', "text/plain"),
    ("/v1/completions", json.dumps({"prompt": "big " * 50_000, "max_tokens": 2}).encode(), "application/json"),
]


@pytest.fixture(scope="module")
def fleet(default_model_dir):
    with Fleet(3) as running:
        yield running


def text_of(path: str, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]


async def run_good(client, url, path, body, under_way: asyncio.Queue) -> str:
    if not body["stream"]:
        response = await client.post(url + path, json=body)
        assert response.status_code == 200, response.text
        return text_of(path, response.json())
    pieces = []
    async with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(pieces)
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            if len(pieces) == 3:
                under_way.put_nowait(response.headers["x-prefixserve-replica"])
    raise AssertionError(f"the stream ended without [DONE] after {len(pieces)} chunks")


def test_good_requests_survive_a_killed_replica_and_hostile_traffic(fleet):
    goods = good_requests()
    with httpx.Client(timeout=RUN_TIMEOUT) as client:
        reference = [
            text_of(path, client.post(fleet.url + path, json={**body, "stream": False}).json()) for path, body in goods
        ]
    before = down_counts(fleet)

    async def run():
        async with httpx.AsyncClient(timeout=RUN_TIMEOUT) as client:
            under_way: asyncio.Queue = asyncio.Queue()
            stop = asyncio.Event()
            hostile_statuses = []
            busy_at_kill = []

            async def hostile():
                for path, raw, content_type in itertools.islice(itertools.cycle(HOSTILE), MAX_HOSTILE):
                    if stop.is_set():
                        return
                    response = await client.post(fleet.url + path, content=raw, headers={"content-type": content_type})
                    hostile_statuses.append((path, raw[:80], response.status_code))
                    await asyncio.sleep(0.01)

            async def chaos():
                name = await asyncio.wait_for(under_way.get(), RUN_TIMEOUT)  # a stream is under way here
                replicas = fleet.router.replicas
                # the replica holding the most requests right now (the stream's, if it is still the busiest):
                # the kill must land on work in flight, or the run proves nothing about failover
                streaming = index_of(fleet, name)
                victim = max(range(len(replicas)), key=lambda i: (len(replicas[i].outstanding), i == streaming))
                busy_at_kill.append(len(replicas[victim].outstanding))
                fleet.kill(victim)
                await asyncio.sleep(0.5)
                fleet.restart(victim)
                return victim

            noise = asyncio.create_task(hostile())
            killer = asyncio.create_task(chaos())
            texts = await asyncio.wait_for(
                asyncio.gather(*(run_good(client, fleet.url, path, body, under_way) for path, body in goods)),
                RUN_TIMEOUT,
            )
            stop.set()
            await noise
            return texts, await killer, hostile_statuses, busy_at_kill[0]

    texts, victim, hostile_statuses, busy_at_kill = asyncio.run(run())
    assert texts == reference
    assert busy_at_kill >= 1  # its requests moved: retried whole, or streams continued from their tokens
    metrics = fleet.router.metrics
    assert (
        sum(
            metrics.failovers.labels(r.name)._value.get() + metrics.continued.labels(r.name)._value.get()
            for r in fleet.router.replicas
        )
        >= 1
    )
    assert hostile_statuses and all(status < 500 for _, _, status in hostile_statuses), [
        h for h in hostile_statuses if h[2] >= 500
    ][:5]
    fleet.wait_all_healthy()  # the restarted replica is back
    reasons = down_reasons_since(fleet, before)
    assert reasons[victim], "the killed replica was never marked down"
    assert all(r.startswith(("transport failure", "health check failed")) for r in reasons[victim]), reasons[victim]
    assert [r for i, r in enumerate(reasons) if i != victim] == [[], []]
