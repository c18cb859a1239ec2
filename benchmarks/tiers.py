"""The KV hierarchy below the pool (issue 11), measured on this machine with the built-in model.

    python benchmarks/tiers.py [--quick] [--no-vllm] [--submit sequential|batch] [--results-dir DIR]
                               [--vllm-python /tmp/vllm-peer/bin/python]

1. Latency ladder, float32: bringing back one block and a 2,000-token prefix from the device pool (a
   radix match), host RAM and disk (read, record check, copy into the pool; disk with the page cache
   warm and dropped), beside prefilling them; and the TTFT of that prefix + 16 new tokens from each.
2. A working set larger than the pool: 24 distinct 1,000-token prefixes (+ 20 new tokens, 4 output
   tokens) cycled twice through a pool that holds 3 such prompts. Wall time and token hit rate with the
   tiers off, host only (holding all 24), disk only, host (holding 8) + disk, and vLLM's CPU build
   (prefix caching on, a KV cache of the same bytes). Requests go one at a time; --submit batch sends
   each pass at once.
3. TTFT of a 2,000-token prefix + 16 new tokens served from disk after a restart (page cache dropped)
   versus recomputed, float32 and bfloat16, with the greedy tokens compared.

--quick runs the same code at toy sizes in seconds, without vLLM. Greedy decoding throughout; every
lower-tier hit is fetched (kv_fetch_policy="always"), so each table measures the tiers, not the planner.
Writes <results-dir>/tiers[_quick].json and .png (default benchmarks/results) and prints each path.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiers_report import format_disk_ttft, format_ladder, format_working_set, plot  # noqa: E402
from tiers_setup import (
    EVERYTHING,
    Sizes,
    drop_page_cache,
    engine,
    fetch_seconds,
    kv_bytes_per_token,  # noqa: E402
    random_tokens,
    run_vllm,
    ttft,
    warm_up,
)

RESULTS = Path(__file__).resolve().parent / "results"
FULL = Sizes()
QUICK = Sizes(
    ladder_prefix=128,
    repeats=1,
    num_prefixes=4,
    working_prefix=96,
    working_suffix=8,
    max_tokens=2,
    pool_prompts=1,
    host_small_prompts=2,
    quick=True,
)


# ---- 1. latency ladder ---------------------------------------------------------------------------


def latency_ladder(sizes: Sizes, rng: random.Random, bar) -> dict:
    bytes_per_token = kv_bytes_per_token("float32")
    pool = 4 * (sizes.ladder_prefix + 2 * sizes.suffix) * bytes_per_token
    samples: dict[str, list[float]] = {name: [] for name in ("miss", "device", "host", "disk warm", "disk cold")}
    served: dict[str, dict] = {}
    fetches: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tiers-ladder-") as directory:
        host_llm = engine("float32", pool, kv_host_cache_bytes=1 << 30)
        disk_llm = engine("float32", pool, kv_disk_cache_dir=directory)
        for _ in range(sizes.repeats):
            prefix = random_tokens(rng, sizes.ladder_prefix)
            new = [random_tokens(rng, sizes.suffix) for _ in range(3)]
            bar.set_postfix_str("ladder: device and host")
            for name, prompt in (("miss", prefix + new[0]), ("device", prefix + new[1])):
                samples[name].append(ttft(host_llm, prompt, served, name))
            host_llm.engine.cache.evict(EVERYTHING)  # cold blocks spill to host RAM
            samples["host"].append(ttft(host_llm, prefix + new[2], served, "host"))
            bar.set_postfix_str("ladder: disk")
            ttft(disk_llm, prefix + new[0], {}, "")
            disk_llm.engine.tiers["disk"].flush()
            for name, prompt in (("disk cold", prefix + new[1]), ("disk warm", prefix + new[2])):
                disk_llm.engine.cache.evict(EVERYTHING)
                if name == "disk cold":
                    drop_page_cache(Path(directory))
                samples[name].append(ttft(disk_llm, prompt, served, name))
            bar.update(1)
        bar.set_postfix_str("ladder: fetch timings")
        num_blocks = sizes.ladder_prefix // host_llm.engine.config.block_size
        for num in (1, num_blocks):
            for source, llm in (
                ("device", host_llm),
                ("host", host_llm),
                ("disk warm", disk_llm),
                ("disk cold", disk_llm),
            ):
                fetches.setdefault(source, {})[str(num)] = [
                    fetch_seconds(llm, source, prefix + new[2], num, Path(directory)) for _ in range(5)
                ]
        prefill_one_block = [
            ttft(host_llm, random_tokens(rng, host_llm.engine.config.block_size), {}, "")
            for _ in range(max(3, sizes.repeats))
        ]
        for llm in (host_llm, disk_llm):
            llm.close()
    bar.update(1)
    return {
        "prefix_tokens": sizes.ladder_prefix,
        "suffix_tokens": sizes.suffix,
        "block_size": 16,
        "block_bytes": 16 * bytes_per_token,
        "ttft_s": samples,
        "served": served,
        "fetch_s": fetches,
        "prefill_one_block_s": prefill_one_block,
        "num_blocks": num_blocks,
    }


# ---- 2. working set larger than the pool ---------------------------------------------------------


def working_set_prompts(sizes: Sizes, rng: random.Random) -> list[list[list[int]]]:
    prefixes = [random_tokens(rng, sizes.working_prefix) for _ in range(sizes.num_prefixes)]
    return [[prefix + random_tokens(rng, sizes.working_suffix) for prefix in prefixes] for _ in range(sizes.passes)]


def run_ours(options: dict, passes: list[list[list[int]]], sizes: Sizes, submit: str) -> dict:
    from prefixserve import SamplingParams

    llm = engine("float32", **options)
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)
    result = []
    for prompts in passes:
        start = time.perf_counter()
        if submit == "batch":
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        result.append(
            {
                "wall_s": time.perf_counter() - start,
                "completions": [
                    {
                        "output_token_ids": out.token_ids,
                        "ttft": out.metrics.ttft,
                        "num_cached_tokens": out.num_cached_tokens,
                        "by_tier": out.cached_tokens_by_tier,
                    }
                    for out in outputs
                ],
            }
        )
    llm.close()  # flushes pending disk writes (not timed: a server would keep running)
    del llm
    gc.collect()
    return {"passes": result}


def working_set(sizes: Sizes, rng: random.Random, args, bar) -> dict:
    passes = working_set_prompts(sizes, rng)
    bytes_per_token = kv_bytes_per_token("float32")
    prompt_blocks = math.ceil((sizes.working_prefix + sizes.working_suffix + sizes.max_tokens) / 16)
    pool = sizes.pool_prompts * prompt_blocks * 16 * bytes_per_token
    record_bytes = 16 * bytes_per_token + 1024  # a block's KV and its record header, with room to spare
    configs = {
        "tiers off": {},
        f"host only (holds all {sizes.num_prefixes})": {
            "kv_host_cache_bytes": sizes.num_prefixes * prompt_blocks * record_bytes
        },
        "disk only": {},
        f"host (holds {sizes.host_small_prompts}) + disk": {
            "kv_host_cache_bytes": sizes.host_small_prompts * prompt_blocks * record_bytes
        },
    }
    runs, notes = {}, {}
    for name, options in configs.items():
        bar.set_postfix_str(f"working set: {name}")
        with tempfile.TemporaryDirectory(prefix="tiers-working-set-") as directory:
            if "disk" in name:
                options = {**options, "kv_disk_cache_dir": directory}
            runs[name] = run_ours({"kv_cache_memory_bytes": pool, **options}, passes, sizes, args.submit)
        bar.update(1)
    if not args.no_vllm and not sizes.quick:
        bar.set_postfix_str("working set: vLLM (load, compile, run)")
        max_model_len = prompt_blocks * 16
        try:
            run = run_vllm(
                args.vllm_python,
                passes,
                sizes.max_tokens,
                args.submit,
                {"kv_cache_memory_bytes": pool, "max_model_len": max_model_len},
            )
            runs[f"vLLM {run['version']} CPU (block {run['block_size']})"] = run
        except RuntimeError as error:
            notes["vLLM"] = str(error).splitlines()[0]
            print(error, file=sys.stderr)
        bar.update(1)
    return {
        "num_prefixes": sizes.num_prefixes,
        "prefix_tokens": sizes.working_prefix,
        "suffix_tokens": sizes.working_suffix,
        "max_tokens": sizes.max_tokens,
        "passes": sizes.passes,
        "pool_bytes": pool,
        "pool_prompts": sizes.pool_prompts,
        "submit": args.submit,
        "prompt_lens": [[len(prompt) for prompt in prompts] for prompts in passes],
        "runs": runs,
        "notes": notes,
    }


# ---- 3. TTFT from disk after a restart -----------------------------------------------------------


def disk_ttft(dtype: str, sizes: Sizes, rng: random.Random, bar) -> dict:
    from prefixserve import SamplingParams

    prompts = [random_tokens(rng, sizes.ladder_prefix + sizes.suffix) for _ in range(sizes.repeats)]
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)
    pool = 4 * len(prompts[0]) * kv_bytes_per_token(dtype)
    with tempfile.TemporaryDirectory(prefix="tiers-restart-") as directory:
        first = engine(dtype, pool, kv_disk_cache_dir=directory)
        recomputed = []
        for prompt in prompts:
            recomputed.append(first.generate([prompt], params, use_tqdm=False)[0])
            first.engine.tiers["disk"].flush()  # the next prefill does not share the cores with this one's writes
        first.close()
        del first
        gc.collect()
        drop_page_cache(Path(directory))
        start = time.perf_counter()
        second = engine(dtype, pool, kv_disk_cache_dir=directory, warm=False)
        restart_s = time.perf_counter() - start
        report = second.engine.tiers["disk"].rebuild_report
        warm_up(second)
        drop_page_cache(Path(directory))
        from_disk = [second.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        second.close()
    bar.update(1)
    return {
        "dtype": dtype,
        "prefix_tokens": sizes.ladder_prefix,
        "suffix_tokens": sizes.suffix,
        "restart_s": restart_s,
        "records_indexed": report.num_records,
        "index_s": report.seconds,
        "recomputed_ttft_s": [out.metrics.ttft for out in recomputed],
        "disk_ttft_s": [out.metrics.ttft for out in from_disk],
        "disk_tokens": [out.cached_tokens_by_tier["disk"] for out in from_disk],
        "same_tokens": [a.token_ids == b.token_ids for a, b in zip(recomputed, from_disk)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes, no vLLM: a smoke run in seconds")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out of the working-set table")
    parser.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python", help="vLLM's venv python")
    parser.add_argument(
        "--submit",
        choices=["sequential", "batch"],
        default="sequential",
        help="working set: one request at a time, or each pass submitted at once",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where the JSON and PNG go")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rng = random.Random(f"tiers-{args.seed}")
    started = time.perf_counter()
    num_steps = sizes.repeats + 1 + 4 + (not (args.no_vllm or sizes.quick)) + 2
    # Other processes on a shared machine only ever add time: the 1-minute load average after each section says
    # how busy it was besides this run (which itself keeps about 1-2 cores busy).
    load = {"start": os.getloadavg()[0]}
    with tqdm(total=num_steps, desc="tiers", disable=None) as bar:  # a bar on a terminal only
        ladder = latency_ladder(sizes, rng, bar)
        load["ladder"] = os.getloadavg()[0]
        print("\n".join(format_ladder(ladder)), flush=True)
        working = working_set(sizes, rng, args, bar)
        load["working set"] = os.getloadavg()[0]
        print("\n".join(format_working_set(working)), flush=True)
        restart = [disk_ttft(dtype, sizes, rng, bar) for dtype in ("float32", "bfloat16")]
        load["restart"] = os.getloadavg()[0]
        print("\n".join(format_disk_ttft(restart)), flush=True)
    print(f"load average (1 min, {os.cpu_count()} cores): " + ", ".join(f"{k} {v:.2f}" for k, v in load.items()))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / ("tiers_quick" if args.quick else "tiers")
    lines = format_ladder(ladder) + [""] + format_working_set(working) + [""] + format_disk_ttft(restart)
    data = {
        "sizes": asdict(sizes),
        "table": lines,
        "ladder": ladder,
        "working_set": working,
        "disk_ttft": restart,
        "load_average": load,
    }
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(f"wrote {stem.with_suffix('.json')}")
    plot(ladder, working, restart, stem.with_suffix(".png"))
    print(f"wrote {stem.with_suffix('.png')}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
