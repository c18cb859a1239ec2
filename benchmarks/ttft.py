"""Time to first token on a prefix-cache hit vs a miss, against the floor of a bare forward.

    python benchmarks/ttft.py [--dtype float32|bfloat16] [--lengths 256,512,1024,2048,3072] [--repeats 3]

For each cached-prefix length L with a 20-token new suffix, on the built-in model:
  miss   prefixserve, L+20 tokens, nothing cached
  hit    prefixserve, L cached + 20 new
  floor  transformers: a forward of the 20 new tokens over an already-filled KV (past_key_values)
  hf     transformers: an eager forward over all L+20 tokens (what a miss costs without us)
Prints a table, saves benchmarks/results/ttft_<dtype>.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from prefixserve import LLM, SamplingParams
from prefixserve.model import ensure_default_model

SUFFIX_LEN = 20
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def engine_ttft(llm: LLM, prompt: list[int]) -> float:
    return llm.generate([prompt], ONE_TOKEN, use_tqdm=False)[0].metrics.ttft


def hf_times(model, prefix: list[int], suffix: list[int]) -> tuple[float, float]:
    """(floor: suffix over a filled KV, eager: the whole prompt) in seconds."""
    with torch.inference_mode():
        past = model(torch.tensor([prefix]), use_cache=True).past_key_values
        start = time.perf_counter()
        model(torch.tensor([suffix]), past_key_values=past, use_cache=True)
        floor = time.perf_counter() - start
        start = time.perf_counter()
        model(torch.tensor([prefix + suffix]), use_cache=False)
        eager = time.perf_counter() - start
    return floor, eager


def measure(dtype: str, lengths: list[int], repeats: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model_dir = ensure_default_model()
    max_len = max(lengths) + SUFFIX_LEN
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=(max_len * 4) * 16384, max_num_batched_tokens=max_len, log_stats=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    rng = random.Random(0)
    engine_ttft(llm, random_tokens(rng, 64))  # warm-up
    hf_times(hf, random_tokens(rng, 64), random_tokens(rng, SUFFIX_LEN))
    rows = []
    for length in tqdm(lengths, desc=f"ttft {dtype}", disable=None):  # None: a bar only on a terminal
        miss, hit, floor, eager = [], [], [], []
        for _ in range(repeats):
            prefix = random_tokens(rng, length)
            llm.engine.cache.clear()
            miss.append(engine_ttft(llm, prefix + random_tokens(rng, SUFFIX_LEN)))
            hit_prompt = prefix + random_tokens(rng, SUFFIX_LEN)
            hit.append(engine_ttft(llm, hit_prompt))
            floor_s, eager_s = hf_times(hf, prefix, hit_prompt[length:])
            floor.append(floor_s)
            eager.append(eager_s)
        row = {
            "cached": length,
            "miss": statistics.median(miss),
            "hit": statistics.median(hit),
            "floor": statistics.median(floor),
            "hf_eager": statistics.median(eager),
        }
        row["hit_over_floor"] = row["hit"] / row["floor"]
        row["miss_over_hf"] = row["miss"] / row["hf_eager"]
        row["miss_over_hit"] = row["miss"] / row["hit"]
        rows.append(row)
    return rows


def print_table(rows: list[dict], dtype: str) -> None:
    print(f"TTFT, built-in model, {dtype}, {SUFFIX_LEN} new tokens (milliseconds, median)")
    print(
        f"{'cached':>7} {'miss':>8} {'hit':>8} {'floor':>8} {'hf eager':>9} {'hit/floor':>10} "
        f"{'miss/hf':>8} {'miss/hit':>9}"
    )
    for r in rows:
        print(
            f"{r['cached']:>7} {r['miss'] * 1e3:>8.1f} {r['hit'] * 1e3:>8.1f} {r['floor'] * 1e3:>8.1f} "
            f"{r['hf_eager'] * 1e3:>9.1f} {r['hit_over_floor']:>10.2f} {r['miss_over_hf']:>8.2f} "
            f"{r['miss_over_hit']:>9.1f}"
        )


def plot(rows: list[dict], dtype: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["cached"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in [
        ("miss", "prefixserve miss"),
        ("hit", "prefixserve hit"),
        ("floor", "floor: 20 tokens over filled KV"),
        ("hf_eager", "transformers eager (all tokens)"),
    ]:
        ax.plot(lengths, [r[key] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xlabel("cached prefix tokens (+20 new)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"Time to first token, prefixserve-tiny, {dtype}, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", default="256,512,1024,2048,3072")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = measure(args.dtype, [int(x) for x in args.lengths.split(",")], args.repeats)
    print_table(rows, args.dtype)
    path = Path(f"benchmarks/results/ttft_{args.dtype}.png")
    plot(rows, args.dtype, path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
