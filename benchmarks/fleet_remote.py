"""4 replicas on this machine, with and without a shared Redis KV tier: fleet throughput and hit rate.

Each replica is a real `prefixserve serve` subprocess with a small KV pool. The workload spreads
NUM_PREFIXES long prefixes over the fleet round robin, so every prefix reaches every replica: without
the remote tier each replica computes each prefix itself; with it, the first replica's blocks are
fetched by the others. Prints a table, writes benchmarks/results/fleet_remote.{json,png}.

    python benchmarks/fleet_remote.py [--replicas 4] [--prefixes 8] [--prefix-len 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up in {timeout} s")


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(lambda: socket.create_connection(("127.0.0.1", port), timeout=0.2).close() is None, 20, "redis-server")
    return process, f"redis://127.0.0.1:{port}/0"


def start_replicas(count: int, extra: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    ports = [free_port() for _ in range(count)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixserve.cli",
                "serve",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--kv-cache-memory-bytes",
                str(48 << 20),
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    for url in urls:
        wait_until(lambda url=url: httpx.get(url + "/health", timeout=1).status_code == 200, 120, url)
    return processes, urls


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
        process.wait(timeout=30)


def workload(num_prefixes: int, prefix_len: int, num_replicas: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(replica index, prompt): every prefix once on every replica, round robin, prefixes interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 8000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for round_index in range(num_replicas):
        for index, prefix in enumerate(prefixes):
            requests.append(
                ((index + round_index) % num_replicas, prefix + [rng.randrange(10, 8000) for _ in range(8)])
            )
    return requests


def run(urls: list[str], requests, concurrency: int) -> dict:
    def one(item):
        replica, prompt = item
        response = httpx.post(
            urls[replica] + "/v1/completions",
            timeout=600,
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        response.raise_for_status()
        return response.json()["usage"]

    start = time.perf_counter()
    # One wave per round: the first round computes every prefix somewhere before the others ask for it.
    usages = []
    per_round = len(requests) // len(urls)
    with ThreadPoolExecutor(concurrency) as pool:
        for wave in range(len(urls)):
            usages += list(pool.map(one, requests[wave * per_round : (wave + 1) * per_round]))
            time.sleep(0.5)  # let write-through reach Redis (it runs in the background)
    wall = time.perf_counter() - start
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    by_tier: dict[str, int] = {}
    for usage in usages:
        for tier, tokens in usage["prompt_tokens_details"]["cached_tokens_by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + tokens
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {
        "wall_seconds": wall,
        "requests": len(usages),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "cached_by_tier": by_tier,
        "requests_per_second": len(usages) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1000)
    args = parser.parse_args()
    requests = workload(args.prefixes, args.prefix_len, args.replicas)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        redis, url = start_redis(directory)
        secret = Path(directory) / "kv-tier.secret"  # the fleet's secret: every replica seals and checks records
        secret.write_text(secrets.token_hex(32) + "\n")
        secret.chmod(0o600)
        try:
            for name, extra in (
                ("local only", []),
                ("shared Redis tier", ["--kv-remote-url", url, "--kv-tier-secret-file", str(secret)]),
            ):
                processes, urls = start_replicas(args.replicas, extra)
                try:
                    results[name] = run(urls, requests, concurrency=args.replicas)
                finally:
                    stop(processes)
        finally:
            redis.kill()
            redis.wait(timeout=10)
    print(
        f"{args.replicas} replicas (48 MiB KV pools), {args.prefixes} prefixes of {args.prefix_len} tokens, "
        f"each sent once to every replica ({len(requests)} requests, {os.cpu_count()} cores)"
    )
    print(f"{'configuration':<20} {'wall s':>7} {'req/s':>6} {'hit rate':>8}  cached device/remote")
    for name, result in results.items():
        tiers = result["cached_by_tier"]
        print(
            f"{name:<20} {result['wall_seconds']:7.1f} {result['requests_per_second']:6.2f} "
            f"{result['hit_rate']:8.1%}  {tiers.get('device', 0):,}/{tiers.get('remote', 0):,}"
        )
    local, shared = results["local only"], results["shared Redis tier"]
    print(f"shared Redis tier: {local['wall_seconds'] / shared['wall_seconds']:.2f}x the local-only throughput")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "fleet_remote.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    plot(results, RESULTS / "fleet_remote.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(results)
    left.bar(names, [results[n]["wall_seconds"] for n in names], color=["tab:gray", "tab:blue"])
    left.set_ylabel("wall time (s)")
    left.set_title("fleet wall time")
    right.bar(names, [100 * results[n]["hit_rate"] for n in names], color=["tab:gray", "tab:blue"])
    right.set_ylabel("token hit rate (%)")
    right.set_title("prompt tokens served from a cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
