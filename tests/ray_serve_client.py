"""The client side of tests/test_ray_serve.py, run inside the test's loopback-only network namespace.

Usage: python ray_serve_client.py GCS_ADDRESS HTTP_URL NODE_RESOURCE [pd]. Prints one JSON object: where the
engine replicas run, the cached tokens of shared-prefix repeats, what a stream and the Anthropic route
answered, and every request's status while the node holding NODE_RESOURCE loses its raylet mid-run. With
`pd` (prefill replicas in front of the engine replicas): where each deployment runs, and what each request's
engine replica took from which tier.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import httpx

GCS, URL, DOOMED_RESOURCE = sys.argv[1], sys.argv[2], sys.argv[3]
MODE = sys.argv[4] if len(sys.argv) > 4 else "main"
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "tau")


def replica_nodes() -> dict:
    """Engine replica -> the node it runs on, from the GCS's actor table."""
    import ray
    from ray._private import state

    nodes = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    alive = [actor for actor in state.actors().values() if actor["State"] == "ALIVE"]
    engines = [actor["Address"]["NodeID"] for actor in alive if actor["ActorClassName"].endswith(":PrefixserveEngine")]
    prefills = [
        actor["Address"]["NodeID"] for actor in alive if actor["ActorClassName"].endswith(":PrefixservePrefill")
    ]
    return {
        "engine_nodes": engines,
        "prefill_nodes": prefills,
        "doomed_nodes": [node for node, resources in nodes.items() if DOOMED_RESOURCE in resources],
    }


def wait_until_running(limit_seconds: float = 240.0) -> None:
    """Until Serve reports the application RUNNING (`serve run --non-blocking` returns before); SystemExit with
    Serve's own message when it failed to deploy."""
    from ray import serve

    deadline = time.monotonic() + limit_seconds
    while time.monotonic() < deadline:
        application = serve.status().applications.get("default")
        if application is not None and application.status == "RUNNING":
            return
        if application is not None and application.status == "DEPLOY_FAILED":
            raise SystemExit(f"the application failed to deploy: {application.message}")
        time.sleep(1.0)
    raise SystemExit(f"the application is not running after {limit_seconds:.0f} s: {serve.status()}")


def doomed_node_dead() -> bool:
    import ray

    return not any(node["Alive"] for node in ray.nodes() if DOOMED_RESOURCE in node["Resources"])


def prompt(session: int, turn: int) -> str:
    system = " ".join(WORDS[(session + i) % len(WORDS)] for i in range(48))  # 48 words: several blocks
    return f"session {session}: {system}. turn {turn}"


def cached(answer: httpx.Response) -> int:
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def repeats(client: httpx.Client) -> list:
    """Six sessions, four turns each, one after another: (session, turn, prompt tokens, cached tokens)."""
    rows = []
    for turn in range(4):
        for session in range(6):
            answer = client.post(URL + "/v1/completions", json={"prompt": prompt(session, turn), "max_tokens": 2})
            answer.raise_for_status()
            usage = answer.json()["usage"]
            rows.append((session, turn, usage["prompt_tokens"], cached(answer)))
    return rows


def pass_through(client: httpx.Client) -> dict:
    chunks = []
    with client.stream(
        "POST",
        URL + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "stream": True},
    ) as answer:
        status = answer.status_code
        for line in answer.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    messages = client.post(
        URL + "/v1/messages",
        json={"model": "prefixserve-tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]},
    )
    bad = client.post(URL + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    return {
        "stream_status": status,
        "stream_done": bool(chunks) and chunks[-1] == "[DONE]",
        "stream_chunks": len(chunks),
        "messages_status": messages.status_code,
        "messages_type": messages.json().get("type"),
        "bad_status": bad.status_code,
        "bad_param": bad.json().get("error", {}).get("param"),
    }


def raylet_pid() -> int:
    """The raylet of the node started with DOOMED_RESOURCE (its command line carries its resources)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    words = file.read().split(b"\0")
            except OSError:
                continue
            if words and words[0].endswith(b"/raylet") and any(DOOMED_RESOURCE.encode() in w for w in words):
                return int(entry)
    raise RuntimeError("no raylet found for the node to lose")


async def node_loss(kill_after: int = 8, after_death: int = 16, limit_seconds: float = 150.0) -> dict:
    """Requests four at a time; the doomed node's raylet is killed once `kill_after` have answered, and requests
    go on until the cluster has declared the node dead and `after_death` more have answered (or the limit)."""
    statuses: list = []
    state = {"killed_at": None, "dead_at": None, "answered_at_death": None}
    deadline = time.monotonic() + limit_seconds

    async def watch() -> None:
        while state["dead_at"] is None and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            if state["killed_at"] is not None and await asyncio.to_thread(doomed_node_dead):
                state["dead_at"], state["answered_at_death"] = time.monotonic(), len(statuses)

    def more() -> bool:
        if time.monotonic() > deadline:
            return False
        return state["dead_at"] is None or len(statuses) < state["answered_at_death"] + after_death

    async with httpx.AsyncClient(timeout=180) as client:

        async def worker(first: int) -> None:
            i = first
            while more():
                try:
                    answer = await client.post(
                        URL + "/v1/completions", json={"prompt": prompt(i % 6, 10 + i), "max_tokens": 16}
                    )
                    statuses.append(answer.status_code)
                except httpx.HTTPError as error:
                    statuses.append(repr(error))
                i += 4
                if len(statuses) >= kill_after and state["killed_at"] is None:
                    state["killed_at"] = time.monotonic()
                    os.kill(raylet_pid(), signal.SIGKILL)

        await asyncio.gather(watch(), *(worker(i) for i in range(4)))
    killed = state["killed_at"]
    return {
        "statuses": statuses,
        "node_declared_dead": state["dead_at"] is not None,
        "seconds_to_declared_dead": round(state["dead_at"] - killed, 1) if state["dead_at"] else None,
        "answered_after_kill": len(statuses) - kill_after,
    }


def disaggregated(client: httpx.Client) -> list:
    """Three new prompts, each twice: (turn, prompt tokens, cached tokens by tier, text)."""
    rows = []
    for turn in range(2):
        for session in range(3):
            answer = client.post(
                URL + "/v1/completions", json={"prompt": prompt(10 + session, 0), "max_tokens": 6, "temperature": 0}
            )
            answer.raise_for_status()
            body = answer.json()
            details = body["usage"]["prompt_tokens_details"]
            rows.append(
                (turn, body["usage"]["prompt_tokens"], details["cached_tokens_by_tier"], body["choices"][0]["text"])
            )
    return rows


def main() -> None:
    import ray

    ray.init(address=GCS, logging_level="ERROR", log_to_driver=False)
    wait_until_running()
    report = replica_nodes()
    if MODE == "pd":
        with httpx.Client(timeout=120) as client:
            report["pd"] = disaggregated(client)
        print(json.dumps(report))
        return
    with httpx.Client(timeout=120) as client:
        report["repeats"] = repeats(client)
        report["pass_through"] = pass_through(client)
    report["node_loss"] = asyncio.run(node_loss())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
