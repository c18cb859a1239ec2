"""Model step times (prefill, cache hit, decode) of the built-in model, to price a numerics change.

    PYTHONPATH=<tree> python benchmarks/bf16_step_time.py [--dtype bfloat16] [--repeats 5] [--threads 1]

Runs the model directly over a paged cache (no engine, no scheduler), each case `repeats`
times after one warm-up, and prints the median and min milliseconds per step. Compare two trees
by pointing PYTHONPATH at each (e.g. `git archive <commit> | tar -x -C /tmp/base`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import prefixserve
from prefixserve.model import AttentionMetadata, ensure_default_model, load_model

BLOCK_SIZE = 16


def cases(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    """Case name -> sequences as (past tokens already cached, new tokens this step)."""
    decode_lens = [rng.randrange(200, 900) for _ in range(16)]
    return {
        "prefill 512": [(0, 512)],
        "prefill 2000": [(0, 2000)],
        "hit 2000+20": [(2000, 20)],
        "4 chunks of 128 after 256": [(256, 128)] * 4,
        "decode x1 @512": [(511, 1)],
        "decode x16 @200-900": [(n, 1) for n in decode_lens],
        "decode x64 @300": [(299, 1)] * 64,
        "decode x32 @300 shared 288": [(299, 1)] * 32,
    }


# Case name -> leading blocks every sequence's table shares (a prefix-cache hit: the cascade's case).
SHARED_BLOCKS = {"decode x32 @300 shared 288": 288 // BLOCK_SIZE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="comma-separated case names (prefixes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load_model(ensure_default_model(), dtype, "cpu").model
    model.pack_linear_weights(batch_size_hint=2048)
    config = model.config
    rng = random.Random(0)
    all_cases = cases(rng)
    if args.only:
        wanted = args.only.split(",")
        all_cases = {name: seqs for name, seqs in all_cases.items() if any(name.startswith(w) for w in wanted)}
    num_blocks = max(sum(-(-(past + new) // BLOCK_SIZE) for past, new in seqs) for seqs in all_cases.values())
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(config.num_hidden_layers)]
    print(f"{prefixserve.__file__}  {args.dtype}, {torch.get_num_threads()} threads, median (min) of {args.repeats}")
    for name, seqs in all_cases.items():
        shared = list(range(SHARED_BLOCKS.get(name, 0)))
        tables, next_block = [], len(shared)
        for past, new in seqs:
            count = -(-(past + new) // BLOCK_SIZE) - len(shared)
            tables.append(shared + list(range(next_block, next_block + count)))
            next_block += count
        query_lens = [new for _, new in seqs]
        seq_lens = [past + new for past, new in seqs]
        input_ids = torch.tensor([rng.randrange(10, 8000) for _ in range(sum(query_lens))])
        last_rows = torch.tensor([sum(query_lens[: i + 1]) - 1 for i in range(len(seqs))])
        times = []
        with torch.inference_mode():
            for _ in range(args.repeats + 1):
                began = time.perf_counter()
                meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
                hidden = model(input_ids, meta.positions, caches, meta)
                model.compute_logits(hidden.index_select(0, last_rows))
                times.append(time.perf_counter() - began)
        times = times[1:]
        print(f"{name:<28} {statistics.median(times) * 1e3:8.1f} ms ({min(times) * 1e3:.1f})")


if __name__ == "__main__":
    main()
