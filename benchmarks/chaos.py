"""A chaos run through the router: 3 real replicas, kill -9, SIGSTOP, a rolling deploy, hostile traffic.

    python benchmarks/chaos.py [--minutes 10] [--clients 3] [--hostile-share 0.1] [--max-requests 12000]

Three `prefixserve serve` replicas of the built-in model (version A) behind `prefixserve route`
(kv_aware, --progress-timeout 5). Client threads send good requests (plain and streamed, chat and
completions, some sharing a long preamble) and, at --hostile-share of their requests, hostile ones
(malformed bodies, wrong types, a huge body, bad credentials, a surrogate in a string, a version no
replica serves). Over the run, at fixed fractions of it:

    10%  kill -9 r0, restarted (A) 10 s later      55%  kill -9 r1, restarted on version B 10 s later
    25%  SIGSTOP r1 for 20 s, then SIGCONT          70%  SIGSTOP r2 for 20 s, then SIGCONT
    40%  SIGTERM r2 (drains), restarted on B        85%  SIGTERM r0 (drains), restarted on B

Version B is the same checkpoint with seeded noise on every weight (prefixserve.model.weights.versions), so the
run ends as a finished rolling deploy. A good request counts as served when it is a 200 whose whole text
equals the reference of the version its system_fingerprint names (computed up front on each version
directly, cold); anything else is a client-visible failure, as is a hostile request answered other than
4xx. Bounded: --minutes of chaos and --max-requests in all; each request has a 180 s client timeout.

Prints a table per phase and overall; writes benchmarks/results/chaos.{json,png} (latency over time,
faults marked). Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serve_bench import free_port, start_prefixserve, wait_healthy

RESULTS = Path(__file__).resolve().parent / "results"
ADMIN = "chaos-admin-key"
PREAMBLE = "You are the assistant of a fleet under test; answer in plain words and keep to the point. " * 6
FAULTS = [  # (fraction of the run, action, replica)
    (0.10, "kill", "r0"),
    (0.25, "stop", "r1"),
    (0.40, "deploy", "r2"),
    (0.55, "kill_deploy", "r1"),
    (0.70, "stop", "r2"),
    (0.85, "deploy", "r0"),
]
RESTART_AFTER_KILL = 10.0
STOP_SECONDS = 20.0


def good_requests() -> list[tuple[str, dict]]:
    """24 greedy requests: chat and completions, plain and streamed, half behind a shared preamble."""
    requests = []
    for i in range(24):
        body = {"max_tokens": (16, 32, 24)[i % 3], "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
        prefix = PREAMBLE if i % 4 < 2 else ""
        if i % 3 == 0:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"{prefix}Question {i}?"}]
        else:
            path, body["prompt"] = "/v1/completions", f"{prefix}Request number {i} goes on"
        requests.append((path, body))
    return requests


HOSTILE: list[tuple[str, bytes, dict]] = [  # (path, body, extra headers)
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 2}
        ).encode(),
        {},
    ),
    ("/v1/completions", b"[" * 1001 + b"]" * 1001, {}),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", {}),
    ("/v1/chat/completions", b'{"messages": "x", "max_tokens": "abc"}', {}),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 100000}).encode(), {}),
    ("/v1/completions", json.dumps({"prompt": "big " * 50_000, "max_tokens": 2}).encode(), {}),
    ("/v1/completions", b'{"prompt": "hi", "cache_salt": "\\ud800", "max_tokens": 2}', {}),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "prefixserve@fp_000000", "max_tokens": 2}).encode(), {}),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2', {}),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1, "max_tokens": 2, "stream": True}).encode(), {}),
]


def text_and_fingerprint(path: str, response: httpx.Response, stream: bool) -> tuple[str, set]:
    if not stream:
        answer = response.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
        return text, {answer.get("system_fingerprint")}
    pieces, fingerprints, done = [], set(), False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
            break
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error'].get('code')}: {event['error'].get('message')}")
            fingerprints.add(event.get("system_fingerprint"))
            for choice in event["choices"]:
                pieces.append(choice.get("delta", {}).get("content") or "" if "delta" in choice else choice["text"])
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(pieces), fingerprints


def send_good(client: httpx.Client, url: str, path: str, body: dict) -> tuple[str, set]:
    if not body["stream"]:
        response = client.post(url + path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
        return text_and_fingerprint(path, response, False)
    with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
        return text_and_fingerprint(path, response, True)


class Fleet:
    """The replicas and the router as subprocesses, and the faults done to them."""

    def __init__(self, log, model_a: Path) -> None:
        self.log, self.model_a = log, model_a
        self.ports = {f"r{i}": free_port() for i in range(3)}
        self.processes: dict[str, subprocess.Popen] = {}
        self.router = None
        self.router_url = f"http://127.0.0.1:{free_port()}"

    def start_replica(self, name: str, model: Path) -> None:
        self.processes[name] = start_prefixserve(
            [
                "serve",
                "--model",
                str(model),
                "--port",
                str(self.ports[name]),
                "--admin-api-key",
                ADMIN,
                "--dtype",
                "float32",
                "--enable-kv-events",
                "--log-level",
                "warning",
            ],
            self.log,
        )

    def wait_replica(self, name: str) -> None:
        wait_healthy(f"http://127.0.0.1:{self.ports[name]}", self.processes[name], 180)

    def start(self) -> None:
        for name in self.ports:
            self.start_replica(name, self.model_a)
        for name in self.ports:
            self.wait_replica(name)
        replicas = [
            arg for name, port in self.ports.items() for arg in ("--replica", f"{name}=http://127.0.0.1:{port}")
        ]
        port = self.router_url.rsplit(":", 1)[1]
        self.router = start_prefixserve(
            [
                "route",
                *replicas,
                "--port",
                port,
                "--admin-api-key",
                ADMIN,
                "--policy",
                "kv_aware",
                "--progress-timeout",
                "5",
                "--log-level",
                "warning",
            ],
            self.log,
        )
        wait_healthy(self.router_url, self.router, 120)

    def stop(self) -> None:
        for process in [*self.processes.values(), self.router]:
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait(timeout=10)


def references(log, model: Path, requests: list[tuple[str, dict]]) -> tuple[str, list[str]]:
    """(system_fingerprint, each request's text) from one fresh replica of `model`, asked directly."""
    port = free_port()
    process = start_prefixserve(
        ["serve", "--model", str(model), "--port", str(port), "--dtype", "float32", "--log-level", "warning"], log
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, 180)
        with httpx.Client(timeout=180) as client:
            answers = [send_good(client, f"http://127.0.0.1:{port}", path, body) for path, body in requests]
        fingerprints = set().union(*(found for _, found in answers))
        assert len(fingerprints) == 1, fingerprints
        return fingerprints.pop(), [text for text, _ in answers]
    finally:
        process.kill()
        process.wait(timeout=10)


def run_faults(fleet: Fleet, model_b: Path, began: float, seconds: float, events: list, stop: threading.Event) -> None:
    for fraction, action, name in FAULTS:
        if stop.wait(max(0.0, began + fraction * seconds - time.monotonic())):
            return
        process = fleet.processes[name]
        events.append((time.monotonic() - began, f"{action} {name}"))
        if action in ("kill", "kill_deploy"):
            process.kill()
            process.wait(timeout=30)
            stop.wait(RESTART_AFTER_KILL)
            fleet.start_replica(name, model_b if action == "kill_deploy" else fleet.model_a)
            fleet.wait_replica(name)
        elif action == "stop":
            os.kill(process.pid, signal.SIGSTOP)
            stop.wait(STOP_SECONDS)
            os.kill(process.pid, signal.SIGCONT)
        else:  # deploy: SIGTERM (it drains what it holds), then the new version on the same port
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
            fleet.start_replica(name, model_b)
            fleet.wait_replica(name)
        events.append((time.monotonic() - began, f"{name} back"))  # healthy again


def client_loop(
    url: str,
    requests,
    expected: dict,
    versions: dict,
    hostile_share: float,
    deadline: float,
    budget,
    seed: int,
    results: list,
    began: float,
) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=180) as client:
        while time.monotonic() < deadline and next(budget, None) is not None:
            sent = time.monotonic()
            if rng.random() < hostile_share:
                path, body, headers = rng.choice(HOSTILE)
                try:
                    status = client.post(
                        url + path, content=body, headers={"content-type": "application/json", **headers}
                    ).status_code
                    failure = None if 400 <= status < 500 else f"hostile answered {status}"
                except httpx.HTTPError as error:
                    failure = f"hostile: {type(error).__name__}"
                results.append(
                    {"t": sent - began, "kind": "hostile", "seconds": time.monotonic() - sent, "failure": failure}
                )
                continue
            index = rng.randrange(len(requests))
            path, body = requests[index]
            version = None
            try:
                text, fingerprints = send_good(client, url, path, body)
                if len(fingerprints) != 1 or next(iter(fingerprints)) not in expected:
                    failure = f"system_fingerprint {sorted(map(str, fingerprints))}: not exactly one known version"
                elif text != expected[next(iter(fingerprints))][index]:
                    failure = "text differs from its version's reference"
                else:
                    failure = None
                version = versions.get(next(iter(fingerprints))) if len(fingerprints) == 1 else None
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
                failure = f"{type(error).__name__}: {error}"
            results.append(
                {
                    "t": sent - began,
                    "kind": "stream" if body["stream"] else "plain",
                    "seconds": time.monotonic() - sent,
                    "failure": failure,
                    "version": version,
                }
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the chaos (faults at fixed fractions)")
    parser.add_argument("--clients", type=int, default=3, help="client threads sending requests back to back")
    parser.add_argument("--hostile-share", type=float, default=0.1, help="share of requests that are hostile")
    parser.add_argument("--max-requests", type=int, default=12000, help="bound on all requests sent")
    args = parser.parse_args()
    from prefixserve.model import ensure_default_model
    from prefixserve.model.weights.versions import write_model_version

    requests = good_requests()
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    log = (work / "servers.log").open("wb")
    model_a = Path(ensure_default_model())
    model_b = write_model_version(model_a, work / "version-b", seed=24)
    print("computing each version's reference answers on a fresh replica ...", flush=True)
    expected = dict([references(log, model_a, requests), references(log, model_b, requests)])
    assert len(expected) == 2, "the two versions must have different fingerprints"
    versions = dict(zip(expected, "AB"))  # fingerprint -> version name
    fleet = Fleet(log, model_a)
    results: list[dict] = []
    events: list[tuple[float, str]] = []
    stop = threading.Event()
    try:
        fleet.start()
        seconds = args.minutes * 60
        began = time.monotonic()
        print(
            f"chaos for {seconds:.0f} s: {args.clients} clients, {args.hostile_share:.0%} hostile; faults at "
            + ", ".join(f"{fraction * seconds:.0f} s {action} {name}" for fraction, action, name in FAULTS),
            flush=True,
        )
        faults = threading.Thread(target=run_faults, args=(fleet, model_b, began, seconds, events, stop))
        faults.start()
        budget = itertools.count() if args.max_requests <= 0 else iter(range(args.max_requests))
        clients = [
            threading.Thread(
                target=client_loop,
                args=(
                    fleet.router_url,
                    requests,
                    expected,
                    versions,
                    args.hostile_share,
                    began + seconds,
                    budget,
                    seed,
                    results,
                    began,
                ),
            )
            for seed in range(args.clients)
        ]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        stop.set()
        faults.join()
    finally:
        stop.set()
        fleet.stop()
        log.close()
    return report(results, events, args, work / "servers.log")


def report(results: list[dict], events: list, args, log_path: Path) -> int:
    edges = [0.0] + [fraction * args.minutes * 60 for fraction, _, _ in FAULTS] + [float("inf")]
    names = ["steady"] + [f"{action} {name}" for _, action, name in FAULTS]
    print(f"{'phase (from)':>22} {'good':>6} {'hostile':>8} {'failed':>7} {'p50 s':>7} {'p99 s':>7} {'max s':>7}")
    for name, low, high in zip(names, edges, edges[1:]):
        rows = [r for r in results if low <= r["t"] < high]
        _print_row(f"{name} ({low:.0f} s)", rows)
    _print_row("all", results)
    failures = [r for r in results if r["failure"]]
    for row in failures[:20]:
        print(f"  failed at {row['t']:.1f} s ({row['kind']}): {row['failure']}")
    good = [r for r in results if r["kind"] != "hostile"]
    print(
        f"{len(good)} good requests ({sum(r['kind'] == 'stream' for r in good)} streamed; answered by version A "
        f"{sum(r['version'] == 'A' for r in good)}, B {sum(r['version'] == 'B' for r in good)}), "
        f"{len(results) - len(good)} hostile, {len(failures)} client-visible failures; faults: "
        + "; ".join(f"{t:.0f} s {what}" for t, what in events)
        + f" (server logs: {log_path})"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(
        json.dumps(
            {
                "minutes": args.minutes,
                "clients": args.clients,
                "hostile_share": args.hostile_share,
                "events": events,
                "requests": results,
            },
            indent=1,
        )
    )
    written = [RESULTS / "chaos.json", _plot(results, events, RESULTS / "chaos.png")]
    print("wrote " + ", ".join(str(path) for path in written))
    return 1 if failures or not good else 0


def _print_row(name: str, rows: list[dict]) -> None:
    good = sorted(r["seconds"] for r in rows if r["kind"] != "hostile")
    p99 = good[min(len(good) - 1, int(0.99 * len(good)))] if good else float("nan")
    print(
        f"{name:>22} {len(good):>6} {sum(r['kind'] == 'hostile' for r in rows):>8} "
        f"{sum(bool(r['failure']) for r in rows):>7} {statistics.median(good) if good else float('nan'):>7.2f} "
        f"{p99:>7.2f} {max(good) if good else float('nan'):>7.2f}"
    )


def _plot(results: list[dict], events: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 4.2))
    for kind, color in (("plain", "tab:blue"), ("stream", "tab:green"), ("hostile", "tab:gray")):
        rows = [r for r in results if r["kind"] == kind and not r["failure"]]
        axes.scatter([r["t"] for r in rows], [r["seconds"] for r in rows], s=6, color=color, label=kind, alpha=0.6)
    failed = [r for r in results if r["failure"]]
    if failed:
        axes.scatter(
            [r["t"] for r in failed],
            [r["seconds"] for r in failed],
            s=30,
            color="red",
            marker="x",
            label=f"failed ({len(failed)})",
        )
    for t, what in events:
        axes.axvline(t, color="black" if "back" not in what else "0.7", linewidth=0.8, linestyle="--")
        if "back" not in what:
            axes.text(t, axes.get_ylim()[1] * 0.95, what, rotation=90, fontsize=7, va="top", ha="right")
    axes.set(
        xlabel="seconds into the run",
        ylabel="request latency (s)",
        yscale="log",
        title="chaos through the router: 3 replicas, kill -9, SIGSTOP 20 s, rolling deploy, hostile traffic",
    )
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    sys.exit(main())
