"""What prefix caching costs when nothing is shared: caching on vs off, interleaved, many repeats.

The no-sharing workload of compare.py (32 prompts of 1,000 random tokens, 32 output tokens each,
nothing in common) runs on two engines built once, caching on and caching off, in alternating
order (on, off, off, on, ...) so that drift of this machine falls on both alike. Each repeat
uses fresh random prompts (the same for both engines), so the engine with caching on never hits.
Prints every repeat, the median ratio and its spread, and the bookkeeping the cache did.

    python benchmarks/cache_overhead.py [--repeats 8] [--dtype float32] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from prefixserve import LLM, SamplingParams


def prompts_for(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(f"overhead-{seed}")
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(count)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="pairs of runs (each engine runs once per pair)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default=None, help="a checkpoint directory or model name (default: built-in)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    options = dict(dtype=args.dtype, kv_cache_memory_bytes=1 << 30, log_stats=False)
    engines = {"on": LLM(args.model, **options), "off": LLM(args.model, enable_prefix_caching=False, **options)}
    vocab_size = engines["on"].engine.version.config.vocab_size
    timed(engines["on"], prompts_for(-1, 4, 64, vocab_size), 4)  # warm both up (allocator, oneDNN kernels)
    timed(engines["off"], prompts_for(-1, 4, 64, vocab_size), 4)
    seconds = {"on": [], "off": []}
    for repeat in range(args.repeats):
        prompts = prompts_for(repeat, args.requests, args.prompt_len, vocab_size)
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for name in order:
            seconds[name].append(timed(engines[name], prompts, args.max_tokens))
        ratio = seconds["on"][-1] / seconds["off"][-1]
        print(
            f"repeat {repeat + 1:>2}: on {seconds['on'][-1]:6.2f} s  off {seconds['off'][-1]:6.2f} s  "
            f"on/off {ratio:.3f}",
            flush=True,
        )
    ratios = [on / off for on, off in zip(seconds["on"], seconds["off"])]
    stats = engines["on"].engine.cache.stats
    print(f"\n{args.repeats} pairs, {args.requests} x {args.prompt_len} tokens -> {args.max_tokens}, {args.dtype}:")
    print(
        f"  caching on / off: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}, stdev {statistics.stdev(ratios) if len(ratios) > 1 else 0.0:.3f}"
    )
    print(f"  median wall: on {statistics.median(seconds['on']):.2f} s, off {statistics.median(seconds['off']):.2f} s")
    print(
        f"  the cache with caching on: {stats.num_hit_tokens} hit tokens of {stats.num_query_tokens} looked up, "
        f"{stats.num_inserted_blocks} blocks inserted, {stats.num_evicted_blocks} evicted"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
