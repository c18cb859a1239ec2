"""Prefill/decode disaggregation on loopback (issue 28): 1 prefill + 2 decode replicas against 3 whole replicas,
all sharing one redis-server, behind `prefixserve route`, on an agent workload.

Each agent session starts with the same long system prompt and tool list, then takes turns: every turn sends the
whole conversation so far plus a new tool result, streamed. Measured per request: TTFT (the first streamed text),
TPOT (the gaps after it), tokens served from each cache (device, remote: what moved over Redis). Prints a table
with the CPU and saves benchmarks/results/pd_loopback.json.

    python benchmarks/pd_loopback.py [--sessions 6] [--turns 4] [--concurrency 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_remote import RESULTS, free_port, start_redis, start_replicas, stop, wait_until  # noqa: E402

from prefixserve.model.cpu_caps import cpu_name  # noqa: E402

SYSTEM = (
    "You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(), search(query). "
    "Answer with one tool call at a time. "
) * 20


def sessions(count: int, turns: int, seed: int = 0) -> list[list[str]]:
    """Per session, the prompt of each turn: the conversation so far plus a new tool result."""
    rng = random.Random(seed)
    out = []
    for session in range(count):
        prompt, prompts = SYSTEM + f"\nTask {session}: fix the failing test in module_{session}.py.\n", []
        for turn in range(turns):
            prompt += f"\nTool result {turn}: " + " ".join(f"line{rng.randrange(1000)}" for _ in range(60)) + "\n"
            prompts.append(prompt)
        out.append(prompts)
    return out


def stream(url: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, usage = [], None
    body = {
        "model": "prefixserve-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - start, "tpot": statistics.mean(gaps) if gaps else 0.0, "usage": usage}


def run_fleet(router_url: str, work: list[list[str]], concurrency: int, max_tokens: int) -> list[dict]:
    def session(prompts: list[str]) -> list[dict]:
        return [stream(router_url, prompt, max_tokens) for prompt in prompts]

    with ThreadPoolExecutor(concurrency) as pool:
        return [result for results in pool.map(session, work) for result in results]


def start_router(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixserve.cli", "route", "--port", str(port), "--log-level", "warning", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health", timeout=1).json()["healthy_replicas"].__len__() == 3, 120, url)
    return process, url


def summary(results: list[dict]) -> dict:
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    tiers: dict[str, int] = {}
    for r in results:
        for tier, tokens in r["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"].items():
            tiers[tier] = tiers.get(tier, 0) + tokens
    ttft = sorted(r["ttft"] for r in results)
    tpot = sorted(r["tpot"] for r in results)
    return {
        "requests": len(results),
        "ttft_p50": ttft[len(ttft) // 2],
        "ttft_p99": ttft[-1],
        "tpot_p50": tpot[len(tpot) // 2],
        "tpot_p99": tpot[-1],
        "hit_rate": sum(tiers.values()) / prompt,
        "remote_tokens": tiers.get("remote", 0),
        "device_tokens": tiers.get("device", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    work = sessions(args.sessions, args.turns)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        redis, url = start_redis(directory)
        secret = Path(directory) / "kv-tier.secret"
        secret.write_text(secrets.token_hex(32) + "\n")
        secret.chmod(0o600)
        tier = ["--kv-remote-url", url, "--kv-tier-secret-file", str(secret), "--kv-fetch-policy", "always"]
        try:
            for name in ("3 whole replicas", "1 prefill + 2 decode"):
                subprocess.run(["redis-cli", "-u", url, "FLUSHALL"], check=True, capture_output=True)
                if name.startswith("3"):
                    processes, urls = start_replicas(3, tier)
                    routing = [item for u in urls for item in ("--replica", u)]
                else:
                    prefill, prefill_urls = start_replicas(1, [*tier, "--role", "prefill"])
                    decode, decode_urls = start_replicas(2, [*tier, "--role", "decode"])
                    processes = prefill + decode
                    routing = [
                        "--prefill-replica",
                        prefill_urls[0],
                        *[item for u in decode_urls for item in ("--decode-replica", u)],
                    ]
                router, router_url = start_router([*routing, "--kv-remote-url", url])
                try:
                    results[name] = summary(run_fleet(router_url, work, args.concurrency, args.max_tokens))
                finally:
                    stop([router, *processes])
        finally:
            redis.kill()
            redis.wait(timeout=10)
    print(
        f"{cpu_name()}, built-in model, float32; {args.sessions} agent sessions x {args.turns} turns, "
        f"{args.concurrency} at once, {args.max_tokens} tokens each, one redis-server"
    )
    print("| fleet | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | hit rate | tokens over Redis |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['ttft_p50'] * 1e3:,.0f} ms | {r['ttft_p99'] * 1e3:,.0f} ms | {r['tpot_p50'] * 1e3:,.1f} ms"
            f" | {r['tpot_p99'] * 1e3:,.1f} ms | {r['hit_rate']:.1%} | {r['remote_tokens']:,} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "pd_loopback.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
