"""A deploy under load: hit rate and TTFT over time across a hot reload to a new model version.

A real `prefixserve serve` (subprocess, the built-in model) serves closed-loop chat clients;
partway through, POST /v1/admin/reload swaps in a new version (the built-in weights moved by
seeded noise: same KV layout, new fingerprint). Nothing of the old version may match after the
swap, so the hit rate dips to zero and recovers as the new version's prefixes are computed again.
Three runs:

    system-prompt          clients share one long system prompt, each question new
    system-prompt, pinned  the same, with the system prompt pinned by the operator: the reload
                           warms it again on the new version before any request runs on it
    multi-turn             each client carries on its own conversation (prompts grow by a turn)

Prints a table (before / the second after the swap / time to recover), writes
benchmarks/results/deploy.{json,png}.

    python benchmarks/deploy.py [--duration 45] [--reload-at 15] [--clients 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
ADMIN = "deploy-admin-key"
SYSTEM = (
    "You are the support assistant of a company that sells garden tools. Answer in two sentences, cite the "
    "manual section when you can, never promise refunds, and escalate safety questions. "
) * 6
SHORT_SYSTEM = "You are the support assistant of a company that sells garden tools. Answer in two sentences."
WINDOW = 1.0  # seconds of the rolling hit rate and TTFT
AFTER = 1.0  # seconds after the swap that the table reports as "the dip"
RECOVERED = 0.9  # recovered: the rolling hit rate is back to this fraction of its level before the reload


WORDS = (
    "rust",
    "handle",
    "hedge",
    "trimmer",
    "warranty",
    "loose",
    "noise",
    "battery",
    "edge",
    "sharpen",
    "bent",
    "replacement",
    "order",
    "broken",
    "spring",
    "grip",
    "cut",
    "branch",
    "motor",
    "charger",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def perturbed_copy(source: Path, target: Path, seed: int) -> Path:
    """The checkpoint with every weight moved by seeded noise: a new version, same KV layout."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    moved = (
        {
            name: (t.float() + torch.randn(t.shape, generator=generator) * t.float().std() * 0.3).to(t.dtype)
            for name, t in sorted(weights.items())
        }
        if weights
        else {}
    )
    save_file({name: tensor.contiguous() for name, tensor in moved.items()}, str(target / "model.safetensors"))
    return target


def start_server(model: Path, port: int, log) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "prefixserve.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--admin-api-key",
        ADMIN,
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--dtype",
        "float32",
        "--hot-prefix-min-requests",
        "0",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not come up in 120 s")


def chat(client: httpx.Client, url: str, messages: list[dict]) -> dict:
    """One streamed chat completion: TTFT, prompt and cached tokens, the reply and the version."""
    began = time.perf_counter()
    ttft, parts, usage, fingerprint = None, [], None, None
    body = {
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            fingerprint = chunk.get("system_fingerprint", fingerprint)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - began
                    parts.append(text)
    ttft = ttft if ttft is not None else time.perf_counter() - began
    return {
        "ok": True,
        "ttft": ttft,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "reply": "".join(parts),
        "fingerprint": fingerprint,
    }


def client_loop(url: str, workload: str, index: int, start: float, stop: float, records: list, lock) -> None:
    rng = random.Random(index)
    system = SHORT_SYSTEM if workload == "multi-turn" else SYSTEM  # there the history is what is reused
    conversation = [{"role": "system", "content": system}]
    with httpx.Client() as client:
        while time.monotonic() < stop:
            question = (
                f"Customer {index}-{rng.randrange(10**6)} asks about blade number {rng.randrange(500)}. "
                + "They describe the problem at length: "
                + " ".join(rng.choice(WORDS) for _ in range(40))
            )
            if workload == "multi-turn":
                if len(conversation) > 13:  # a new session every six turns
                    conversation = [{"role": "system", "content": system}]
                messages = conversation + [{"role": "user", "content": question}]
            else:
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            sent = time.monotonic() - start
            result = chat(client, url, messages)
            result["t"], result["client"] = sent, index
            with lock:
                records.append(result)
            if workload == "multi-turn" and result["ok"]:
                conversation = messages + [{"role": "assistant", "content": result["reply"]}]


def run(workload: str, pinned: bool, model_a: Path, model_b: Path, args, log) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(model_a, port, log)
    headers = {"Authorization": f"Bearer {ADMIN}"}
    try:
        if pinned:
            pin = httpx.post(
                url + "/v1/cache/pin",
                headers=headers,
                timeout=120,
                json={"messages": [{"role": "system", "content": SYSTEM}]},
            )
            pin.raise_for_status()
        records, lock = [], threading.Lock()
        start = time.monotonic()
        stop = start + args.duration
        threads = [
            threading.Thread(target=client_loop, args=(url, workload, i, start, stop, records, lock))
            for i in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, start + args.reload_at - time.monotonic()))
        reload_began = time.monotonic() - start
        reload = httpx.post(url + "/v1/admin/reload", headers=headers, json={"model": str(model_b)}, timeout=300)
        reload_ended = time.monotonic() - start
        reload.raise_for_status()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return summarize(workload + (", pinned" if pinned else ""), records, reload_began, reload_ended, reload.json())


def rolling(records: list, end: float) -> tuple[float, float]:
    """(token hit rate, median TTFT) of the requests sent in the WINDOW before `end`."""
    window = [r for r in records if r["ok"] and end - WINDOW <= r["t"] < end]
    if not window:
        return float("nan"), float("nan")
    prompt = sum(r["prompt_tokens"] for r in window)
    return sum(r["cached_tokens"] for r in window) / prompt, statistics.median(r["ttft"] for r in window)


def summarize(name: str, records: list, reload_began: float, reload_ended: float, report: dict) -> dict:
    ok = [r for r in records if r["ok"]]
    before = [r for r in ok if r["t"] < reload_began]
    new_version = "fp_" + report["model_fingerprint"][:16]
    # Served by the new version (those held at the gate during the swap included), in the first AFTER s.
    after = [r for r in ok if r["fingerprint"] == new_version and r["t"] < reload_ended + AFTER]

    def hit_rate(rs):
        return sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))

    def p50(rs):
        return statistics.median(r["ttft"] for r in rs) if rs else float("nan")

    level = hit_rate(before)
    firsts = []  # each client's first request after the swap: where the dip is
    for client in sorted({r["client"] for r in ok}):
        mine = [r for r in ok if r["client"] == client and r["fingerprint"] == new_version]
        firsts += mine[:1]
    recovered_at = None
    t = reload_ended + 0.25
    while t <= max((r["t"] for r in ok), default=0) + 0.25:
        rate, _ = rolling(ok, t)
        if rate == rate and rate >= RECOVERED * level:
            recovered_at = t - reload_ended
            break
        t += 0.25
    timeline = [
        (round(t, 2), *rolling(ok, t)) for t in [x * 0.5 for x in range(1, int(max(r["t"] for r in ok) * 2) + 2)]
    ]
    return {
        "name": name,
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "hit_rate_before": level,
        "ttft_p50_before": p50(before),
        "hit_rate_after": hit_rate(after),
        "hit_rate_first_after": hit_rate(firsts),
        "ttft_p50_first_after": p50(firsts),
        "ttft_p50_after": p50(after),
        "ttft_max_after": max((r["ttft"] for r in after), default=float("nan")),
        "recover_seconds": recovered_at,
        "reload_began": reload_began,
        "reload_ended": reload_ended,
        "reload": report,
        "timeline": timeline,
        "versions_served": sorted({r["fingerprint"] for r in ok}),
    }


def print_table(results: list) -> None:
    print(
        f"{'workload':24} {'requests':>8} {'failed':>6} {'hit before':>10} {'TTFT p50':>9} "
        f"{'first turn after: hit, TTFT':>27} {'hit 1s after':>12} {'TTFT p50/max 1s after':>21} "
        f"{'recovered in':>12} {'held':>7}"
    )
    for r in results:
        recover = "never" if r["recover_seconds"] is None else f"{r['recover_seconds']:.2f} s"
        after = f"{r['ttft_p50_after'] * 1000:.0f} / {r['ttft_max_after'] * 1000:.0f} ms"
        first = f"{r['hit_rate_first_after']:.1%}, {r['ttft_p50_first_after'] * 1000:.0f} ms"
        print(
            f"{r['name']:24} {r['num_requests']:>8} {r['num_failed']:>6} {r['hit_rate_before']:>10.1%} "
            f"{r['ttft_p50_before'] * 1000:>7.0f}ms {first:>27} {r['hit_rate_after']:>12.1%} {after:>21} {recover:>12} "
            f"{r['reload']['held_seconds']:>5.2f} s"
        )
    print(
        "held: how long new requests waited at the gate (the drain and the swap); "
        f"recovered: the rolling {WINDOW:.0f} s hit rate back to {RECOVERED:.0%} of its level before the reload"
    )


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hits, ttft) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in results:
        times = [t for t, _, _ in r["timeline"]]
        hits.plot(times, [h * 100 for _, h, _ in r["timeline"]], label=r["name"])
        ttft.plot(times, [m * 1000 for _, _, m in r["timeline"]], label=r["name"])
    for axis in (hits, ttft):
        axis.axvspan(results[0]["reload_began"], results[0]["reload_ended"], color="grey", alpha=0.2)
        axis.grid(alpha=0.3)
    hits.set_ylabel(f"token hit rate, % (rolling {WINDOW:.0f} s)")
    ttft.set_ylabel("TTFT p50, ms")
    ttft.set_xlabel("seconds (grey: the reload, from the request to its answer)")
    hits.legend()
    hits.set_title("A hot reload under load: the dip and the recovery (prefixserve-tiny, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--reload-at", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    from prefixserve.model import ensure_default_model

    model_a = ensure_default_model()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        model_b = perturbed_copy(model_a, Path(scratch) / "prefixserve-tiny-v2", seed=3)
        with open(Path(scratch) / "server.log", "w") as log:
            for workload, pinned in (("system-prompt", False), ("system-prompt", True), ("multi-turn", False)):
                if sys.stderr.isatty():
                    print(f"running {workload}{', pinned' if pinned else ''} ...", file=sys.stderr)
                results.append(run(workload, pinned, model_a, model_b, args, log))
    print_table(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "deploy.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "deploy.png")
    print(f"wrote {RESULTS / 'deploy.json'} and {RESULTS / 'deploy.png'}")
    return 0 if all(r["num_failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
