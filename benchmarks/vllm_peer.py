"""Runs the workload suite through vLLM's offline `LLM` API; driven by compare.py in vLLM's own venv.

    /tmp/vllm-peer/bin/python benchmarks/vllm_peer.py TASK.json RESULT.json

TASK.json: {"model": DIR, "dtype": "float32", "seed": 0, "workloads": [names], "engine": {...},
            "prefix_caching": true, "ttft_probe": {"prefix_len": 2000, "suffix_len": 20, "repeats": 3}}
RESULT.json: {"version", "warmup_s", "workloads": {name: {"wall_s", "turns": [...]}}, "ttft_probe": {...}}

Imports nothing from prefixserve (it is not installed in vLLM's venv); the workloads module is
standard-library only and imported from this directory, so both engines get identical tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import Completion, Turn, build_workloads, drive, random_tokens  # noqa: E402


def first_token_latency(output) -> float | None:
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", None)
    return latency if latency else None


def decode_seconds(output) -> float | None:
    """First to last output token, on the engine core's clock (both stamps are its monotonic time)."""
    metrics = getattr(output, "metrics", None)
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    return last - first if first and last else None


def make_generate(llm, sampling_params_class):
    from vllm.inputs import TokensPrompt

    def generate(turns: list[Turn]) -> list[Completion]:
        prompts = [TokensPrompt(prompt_token_ids=turn.prompt_token_ids) for turn in turns]
        params = [sampling_params_class(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True) for turn in turns]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            Completion(
                list(output.outputs[0].token_ids),
                first_token_latency(output),
                output.num_cached_tokens,
                decode_seconds(output),
            )
            for output in outputs
        ]

    return generate


def ttft_probe(llm, sampling_params_class, prefix_len: int, suffix_len: int, repeats: int, seed: int) -> dict:
    """Wall time of a one-token request: a miss over prefix+suffix, then a hit on the prefix."""
    import random

    from vllm.inputs import TokensPrompt

    one = sampling_params_class(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(f"ttft-probe-{seed}")
    miss, hit = [], []
    for _ in range(repeats):
        prefix = random_tokens(rng, prefix_len)
        llm.reset_prefix_cache()
        for prompt, times in (
            (prefix + random_tokens(rng, suffix_len), miss),
            (prefix + random_tokens(rng, suffix_len), hit),
        ):
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
            times.append(time.perf_counter() - start)
    return {"miss_s": statistics.median(miss), "hit_s": statistics.median(hit)}


def main() -> None:
    task = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(task.get("kv_cache_gib", 2)))
    from vllm import LLM, SamplingParams, __version__

    start = time.perf_counter()
    llm = LLM(
        model=task["model"],
        dtype=task["dtype"],
        enable_prefix_caching=task.get("prefix_caching", True),
        seed=0,
        disable_log_stats=False,
        **task.get("engine", {}),
    )
    load_s = time.perf_counter() - start
    generate = make_generate(llm, SamplingParams)
    workloads = build_workloads(task["seed"])
    start = time.perf_counter()
    generate([Turn(random_tokens(__import__("random").Random("warm-up"), 64), 4)])  # warm once
    llm.reset_prefix_cache()
    result = {"version": __version__, "load_s": load_s, "warmup_s": time.perf_counter() - start, "workloads": {}}
    for name in task["workloads"]:
        start = time.perf_counter()
        done = drive(workloads[name], generate)
        wall = time.perf_counter() - start
        llm.reset_prefix_cache()
        print(f"vllm {name}: {wall:.2f} s", file=sys.stderr, flush=True)
        result["workloads"][name] = {
            "wall_s": wall,
            "turns": [{"prompt_len": len(turn.prompt_token_ids), **asdict(completion)} for turn, completion in done],
        }
    probe = task.get("ttft_probe")
    if probe:
        result["ttft_probe"] = ttft_probe(
            llm, SamplingParams, probe["prefix_len"], probe["suffix_len"], probe["repeats"], task["seed"]
        )
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
