"""What a hung replica costs a request: the latency it adds, against the progress deadline plus one failover.

Two real `prefixserve serve` replicas (subprocesses, the built-in model) behind `prefixserve route`
(kv_aware, --progress-timeout as given). Each round sends the same requests twice, plain and streamed: once
with both replicas well (the baseline), once with the replica that holds the request stopped with SIGSTOP
shortly after it arrived (a hung host: connections open, no error, nothing more), then SIGCONT. The added
latency of a request is its latency on the hung round minus its baseline; the bound it should keep is the
progress deadline plus one full run of the request elsewhere.

Prints one table of several rounds and writes benchmarks/results/hung_replica.json:

    python benchmarks/hung_replica.py [--rounds 3] [--progress-timeout 5] [--stop-after 0.5]

A stream's "answered" column is the replica it began on (its x-prefixserve-replica header): it was
continued elsewhere from its tokens, and "same text" checks the whole of it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_bench import free_port, start_prefixserve, wait_healthy

RESULTS = Path(__file__).resolve().parent / "results"
ADMIN = "hung-admin-key"


def request(url: str, stream: bool, prompt: str, max_tokens: int) -> tuple[float, str, str]:
    """(seconds, replica that answered, text) of one greedy request; raises on any failure."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    began = time.perf_counter()
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        return (
            time.perf_counter() - began,
            response.headers["x-prefixserve-replica"],
            response.json()["choices"][0]["text"],
        )
    pieces = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        replica = response.headers["x-prefixserve-replica"]
        for line in response.iter_lines():
            if line == "data: [DONE]":
                return time.perf_counter() - began, replica, "".join(pieces)
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                pieces.extend(choice["text"] for choice in event["choices"])
    raise RuntimeError("the stream ended without [DONE]")


def hung_round(url: str, processes: dict, stream: bool, prompt: str, max_tokens: int, stop_after: float):
    """The request, with its replica SIGSTOPped `stop_after` s after the request was sent; (seconds, text)."""
    import threading

    result = {}

    def run():
        result["answer"] = request(url, stream, prompt, max_tokens)

    # The router places a prompt by its prefix: ask once (well) to learn where this prompt goes.
    _, home, _ = request(url, stream, prompt, 1)
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(stop_after)
    os.kill(processes[home].pid, signal.SIGSTOP)
    thread.join(300)
    os.kill(processes[home].pid, signal.SIGCONT)
    seconds, answered_by, text = result["answer"]
    return seconds, home, answered_by, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--progress-timeout", type=float, default=5.0)
    parser.add_argument("--stop-after", type=float, default=0.5, help="seconds after sending before SIGSTOP")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    ports = {f"r{i}": free_port() for i in range(2)}
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    log = tempfile.TemporaryFile()
    processes, router = {}, None
    try:
        for name, port in ports.items():
            processes[name] = start_prefixserve(
                [
                    "serve",
                    "--port",
                    str(port),
                    "--admin-api-key",
                    ADMIN,
                    "--dtype",
                    "float32",
                    "--enable-kv-events",
                    "--log-level",
                    "warning",
                ],
                log,
            )
        for name, port in ports.items():
            wait_healthy(f"http://127.0.0.1:{port}", processes[name], 120)
        replicas = [arg for name, port in ports.items() for arg in ("--replica", f"{name}=http://127.0.0.1:{port}")]
        router = start_prefixserve(
            [
                "route",
                *replicas,
                "--port",
                str(router_port),
                "--admin-api-key",
                ADMIN,
                "--progress-timeout",
                str(args.progress_timeout),
                "--log-level",
                "warning",
            ],
            log,
        )
        wait_healthy(url, router, 120)
        rows = []
        for round_index in range(args.rounds):
            for stream in (False, True):
                prompt = f"Round {round_index} asks the fleet about hung hosts, {'streamed' if stream else 'plain'}:"
                baseline, _, reference = request(url, stream, prompt, args.max_tokens)
                seconds, home, answered_by, text = hung_round(
                    url, processes, stream, prompt, args.max_tokens, args.stop_after
                )
                rows.append(
                    {
                        "round": round_index,
                        "stream": stream,
                        "baseline_s": baseline,
                        "hung_s": seconds,
                        "added_s": seconds - baseline,
                        "bound_s": args.progress_timeout + baseline,
                        "stopped": home,
                        "answered_by": answered_by,
                        "same_text": text == reference,
                    }
                )
                for name, port in ports.items():  # both up again before the next round
                    wait_healthy(f"http://127.0.0.1:{port}", processes[name], 120)
                time.sleep(2.0)
        print(
            f"{'round':>5} {'kind':>6} {'baseline s':>10} {'hung s':>8} {'added s':>8} {'bound s':>8} "
            f"{'stopped':>7} {'answered':>8} {'same text':>9}"
        )
        for row in rows:
            print(
                f"{row['round']:>5} {'stream' if row['stream'] else 'plain':>6} {row['baseline_s']:>10.2f} "
                f"{row['hung_s']:>8.2f} {row['added_s']:>8.2f} {row['bound_s']:>8.2f} {row['stopped']:>7} "
                f"{row['answered_by']:>8} {str(row['same_text']):>9}"
            )
        added = [row["added_s"] for row in rows]
        print(
            f"added latency: median {statistics.median(added):.2f} s, max {max(added):.2f} s "
            f"(deadline {args.progress_timeout:g} s)"
        )
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "hung_replica.json").write_text(
            json.dumps({"progress_timeout": args.progress_timeout, "rows": rows}, indent=1)
        )
        print(f"wrote {RESULTS / 'hung_replica.json'}")
        return 0 if all(row["same_text"] for row in rows) else 1
    finally:
        for process in [*processes.values(), router]:
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
