"""Cost of the cache bookkeeping per request, as the cache grows.

    python benchmarks/cache_ops.py [--sizes 10000,100000,1000000] [--hash sha256]

Prints a table (microseconds per operation and Python bytes per cached block)
and saves benchmarks/results/cache_ops.png.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from pathlib import Path

from tqdm import tqdm

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache

BLOCK_SIZE = 16
PROMPT_LEN = 2000
SCOPE = CacheScope("bench-model", "bench-tokenizer")


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(length)]


def cache_prompt(cache: RadixCache, keyer: BlockKeyer, tokens: list[int]) -> int:
    """Compute-free stand-in for a finished request: insert every full block, then release; returns blocks."""
    keys = keyer.keys(SCOPE.digest, tokens)
    blocks = cache.allocate(len(keys))
    parent: object = SCOPE.digest
    for i, (block, key) in enumerate(zip(blocks, keys)):
        cache.insert(block, key, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], parent)
        parent = block
    cache.release(blocks)
    return len(keys)


def fill(cache: RadixCache, keyer: BlockKeyer, num_blocks: int, rng: random.Random, progress: bool) -> None:
    """Fill the cache with chains of 125 blocks (2,000-token prompts), all released."""
    blocks_per_prompt = PROMPT_LEN // BLOCK_SIZE
    # disable=None: a bar only on a terminal, never redraws into a log file or a pipe
    with tqdm(total=num_blocks, desc=f"fill {num_blocks:,}", leave=False, disable=None if progress else True) as bar:
        while cache.num_cached_blocks + blocks_per_prompt <= num_blocks:
            bar.update(cache_prompt(cache, keyer, random_prompt(rng, PROMPT_LEN)))


def time_per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def measure(num_blocks: int, hash_function: str, progress: bool) -> dict[str, float]:
    rng = random.Random(num_blocks)
    keyer = BlockKeyer(BLOCK_SIZE, hash_function)
    gc.collect()
    tracemalloc.start()
    # One spare prompt's worth of blocks so insert/evict below never starves.
    cache = RadixCache(num_blocks + 2 * PROMPT_LEN // BLOCK_SIZE, BLOCK_SIZE)
    empty = tracemalloc.get_traced_memory()[0]
    fill(cache, keyer, num_blocks, rng, progress)
    filled = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    bytes_per_block = (filled - empty) / cache.num_cached_blocks

    # A cached system prompt plus a new 18-token question: the scenario.
    system = random_prompt(rng, PROMPT_LEN)
    cache_prompt(cache, keyer, system)
    prompt = system + random_prompt(rng, 18)

    keys_us = time_per_call(lambda: keyer.keys(SCOPE.digest, prompt), 200)
    prompt_keys = keyer.keys(SCOPE.digest, prompt)
    match_us = time_per_call(lambda: cache.match(SCOPE.digest, prompt_keys, prompt, record_stats=False), 200)
    hit = cache.match(SCOPE.digest, prompt_keys, prompt)
    assert hit.num_tokens == PROMPT_LEN, hit.num_tokens

    # insert: register one fresh full block under the cached system prompt.
    cache.acquire(hit.blocks)
    fresh = [random_prompt(rng, BLOCK_SIZE) for _ in range(200)]
    start = time.perf_counter()
    for tokens in fresh:
        block = cache.allocate(1)[0]
        cache.insert(block, keyer.block_key(prompt_keys[-1], tokens), tokens, hit.blocks[-1])
        cache.release([block])
    insert_us = (time.perf_counter() - start) / len(fresh) * 1e6
    cache.release(hit.blocks)

    evict_us = time_per_call(lambda: cache.evict(1), 500)
    return {
        "blocks": cache.num_cached_blocks,
        "keys_us": keys_us,
        "match_us": match_us,
        "keys_plus_match_us": keys_us + match_us,
        "insert_us": insert_us,
        "evict_us": evict_us,
        "bytes_per_block": bytes_per_block,
    }


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row["blocks"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in [
        ("keys_us", "keys (2,000 tokens)"),
        ("match_us", "match (125 blocks)"),
        ("insert_us", "insert (1 block)"),
        ("evict_us", "evict (1 block)"),
    ]:
        ax.plot(sizes, [row[name] for row in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("cached blocks")
    ax.set_ylabel("microseconds per operation")
    ax.set_title("prefixserve cache bookkeeping vs cache size")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--sizes", default="10000,100000,1000000", help="cache sizes in blocks")
    parser.add_argument("--hash", default="sha256", choices=["sha256", "xxh3_128"])
    parser.add_argument("--plot", default="benchmarks/results/cache_ops.png")
    args = parser.parse_args()
    rows = [measure(int(size), args.hash, progress=True) for size in args.sizes.split(",")]
    header = (
        f"{'cached blocks':>14} {'keys µs':>9} {'match µs':>9} {'keys+match':>11} {'insert µs':>10} "
        f"{'evict µs':>9} {'B/block':>8}"
    )
    print(f"cache_ops: {PROMPT_LEN}-token prompt, block size {BLOCK_SIZE}, hash {args.hash}")
    print(header)
    for row in rows:
        print(
            f"{row['blocks']:>14,} {row['keys_us']:>9.1f} {row['match_us']:>9.1f} {row['keys_plus_match_us']:>11.1f} "
            f"{row['insert_us']:>10.2f} {row['evict_us']:>9.2f} {row['bytes_per_block']:>8.0f}"
        )
    plot(rows, Path(args.plot))
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
