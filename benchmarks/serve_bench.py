"""vLLM's own benchmark client (`vllm bench serve`, unmodified) against a prefixserve server and a vLLM
server on the same checkpoint, one after the other, on 127.0.0.1.

    python benchmarks/serve_bench.py [--dtype float32] [--model DIR|NAME] [--cpu-isa avx2]
                                     [--vllm-python /tmp/vllm-peer/bin/python] [--datasets prefix,random]

Datasets (vLLM's own generators, seed 0, greedy with EOS ignored, through /v1/completions):
  prefix   --dataset-name prefix_repetition: 4 prefixes of 1,536 tokens, 64-token suffixes, 64 prompts,
           32 output tokens each, 8 requests in flight (a shared-system-prompt service)
  random   --dataset-name random with --random-prefix-len 1,024: every prompt a fixed 1,024-token
           prefix and 256 random tokens of its own, 64 prompts, 32 output tokens, 8 in flight
Both servers get every core (vLLM: VLLM_CPU_OMP_THREADS_BIND, no reserved core); each is started,
warmed by one request, measured and stopped before the other starts. The client asks each server for
/tokenize (its prompts are aligned to the server's tokenizer) and reports duration, TTFT, TPOT (time
per output token after the first) and ITL. compare.py --serve-bench runs this after the suite; under
--cpu-isa every process runs capped (compare.py's docstring says how).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_setup import RESULTS, cap_and_reexecute, resolve_model_dir  # noqa: E402

DATASETS = {
    "prefix": [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "1536",
        "--prefix-repetition-suffix-len",
        "64",
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-output-len",
        "32",
    ],
    "random": [
        "--dataset-name",
        "random",
        "--random-prefix-len",
        "1024",
        "--random-input-len",
        "256",
        "--random-output-len",
        "32",
    ],
}
NUM_PROMPTS, CONCURRENCY = 64, 8
METRICS = (
    "duration",
    "completed",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "output_throughput",
)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_prefixserve(command: list[str], log) -> subprocess.Popen:
    """`prefixserve COMMAND...` (serve, route) as a subprocess of this Python, its output to `log`."""
    return subprocess.Popen([sys.executable, "-m", "prefixserve.cli", *command], stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {timeout:.0f} s")


def server_command(engine: str, model_dir: Path, name: str, dtype: str, port: int, vllm_python: str) -> list[str]:
    if engine == "prefixserve":
        return [
            sys.executable,
            "-m",
            "prefixserve.cli",
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            name,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
    return [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--seed",
        "0",
    ]


def peer_env(engine: str) -> dict:
    env = dict(os.environ)
    if engine == "vllm":
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE="2",
        )
        if env.get("PREFIXSERVE_CPU_ISA"):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "vllm_caps"), env.get("PYTHONPATH", "")]))
    return env


def run_client(vllm_python: str, url: str, name: str, model_dir: Path, dataset: str, out_dir: Path, log) -> dict:
    result_file = f"{dataset}.json"
    command = [
        vllm_python,
        str(HERE / "vllm_bench_client.py"),
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        url,
        "--model",
        name,
        "--tokenizer",
        str(model_dir),
        *DATASETS[dataset],
        "--num-prompts",
        str(NUM_PROMPTS),
        "--max-concurrency",
        str(CONCURRENCY),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result_file,
    ]
    subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=peer_env("client"), timeout=1800)
    found = json.loads((out_dir / result_file).read_text())
    return {metric: found.get(metric) for metric in METRICS}


def bench_engine(
    engine: str, model_dir: Path, name: str, dtype: str, datasets: list[str], vllm_python: str, log_dir: Path
) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_dir / f"{engine}.log", "w")
    process = subprocess.Popen(
        server_command(engine, model_dir, name, dtype, port, vllm_python),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=peer_env(engine),
        start_new_session=True,
    )
    try:
        wait_healthy(url, process, timeout=600)
        httpx.post(url + "/v1/completions", timeout=300, json={"model": name, "prompt": "warm up", "max_tokens": 4})
        results = {}
        for dataset in datasets:
            results[dataset] = run_client(vllm_python, url, name, model_dir, dataset, log_dir, log)
            print(f"  {engine} {dataset}: {results[dataset]['duration']:.1f} s", flush=True)
        return results
    finally:
        try:  # the server and every process it started (vLLM's engine core)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
        log.close()


def table(results: dict, datasets: list[str]) -> list[str]:
    lines = [
        "vllm bench serve (vLLM's own client, unmodified): ratio = prefixserve / vLLM",
        f"{'dataset':<8} {'engine':<12} {'duration s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT mean':>10} "
        f"{'TPOT p99':>10} {'ITL mean':>9} {'out tok/s':>9}",
    ]
    for dataset in datasets:
        for engine in ("prefixserve", "vllm"):
            row = results.get(engine, {}).get(dataset)
            if row is None:
                continue
            lines.append(
                f"{dataset:<8} {engine:<12} {row['duration']:>10.1f} {row['median_ttft_ms']:>8.0f}ms "
                f"{row['p99_ttft_ms']:>8.0f}ms {row['mean_tpot_ms']:>8.1f}ms {row['p99_tpot_ms']:>8.1f}ms "
                f"{row['mean_itl_ms']:>7.1f}ms {row['output_throughput']:>9.1f}"
            )
        ours, theirs = results.get("prefixserve", {}).get(dataset), results.get("vllm", {}).get(dataset)
        if ours and theirs:
            lines.append(
                f"{dataset:<8} {'ratio':<12} {ours['duration'] / theirs['duration']:>9.2f}x "
                f"{ours['median_ttft_ms'] / theirs['median_ttft_ms']:>9.2f}x "
                f"{ours['p99_ttft_ms'] / theirs['p99_ttft_ms']:>9.2f}x "
                f"{ours['mean_tpot_ms'] / theirs['mean_tpot_ms']:>9.2f}x "
                f"{ours['p99_tpot_ms'] / theirs['p99_tpot_ms']:>9.2f}x"
            )
    return lines


def run(
    model_dir: Path,
    name: str,
    dtype: str,
    datasets: list[str],
    vllm_python: str,
    engines: tuple[str, ...] = ("prefixserve", "vllm"),
) -> tuple[dict, list[str]]:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            if engine == "vllm" and not Path(vllm_python).exists():
                print(f"  vllm: not installed ({vllm_python} missing)", flush=True)
                continue
            try:
                results[engine] = bench_engine(engine, model_dir, name, dtype, datasets, vllm_python, Path(tmp))
            except (RuntimeError, subprocess.SubprocessError) as error:
                tail = "".join(Path(tmp, f"{engine}.log").read_text().splitlines(True)[-30:])
                print(f"  {engine} failed: {error}\n{tail}", file=sys.stderr, flush=True)
    return results, table(results, datasets)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or model name (default: built-in)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    parser.add_argument("--cpu-isa", default=None, help="run both servers as a CPU of this variant's class")
    args = parser.parse_args(argv)
    if args.cpu_isa:
        cap_and_reexecute(args.cpu_isa)
    model_dir = resolve_model_dir(args.model)
    name = args.model or "prefixserve-tiny"
    datasets = args.datasets.split(",")
    results, lines = run(model_dir, Path(name).name, args.dtype, datasets, args.vllm_python)
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"serve_bench_{args.dtype}{'_' + args.cpu_isa if args.cpu_isa else ''}.json"
    stem.write_text(json.dumps({"results": results, "table": lines}, indent=1))
    print(f"wrote {stem}")


if __name__ == "__main__":
    main()
