"""How often a cache hit leaves greedy tokens unchanged, end to end through the engine (issue 15).

    PYTHONPATH=<tree> python benchmarks/bf16_cache_agreement.py [--dtype bfloat16] [--prompts 20]

Prompts share a system prefix (as tests/test_engine_cache_reuse.py, which checks float32 exactly).
The reference is caching off, all prompts in one batch. Compared with it, per setting, the share
of requests whose greedy tokens are identical:

    cache on, cold        same batch, caching on (the shared prefix is computed once, in this batch)
    cache on, warm        the same prompts again: every full prefix block is a hit
    one then the rest     the first prompt alone, then the others hit its prefix in one batch
    chunks of 45          max_num_batched_tokens=45: prompts split inside blocks, cold then warm
    cache off, again      caching off a second time (sanity: must be 100%)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from prefixserve import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "bf16_cache_agreement.json"


def token_prompts(num_prompts: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 8000) for _ in range(prefix_len)]
    return [system + [rng.randrange(10, 8000) for _ in range(rng.randrange(3, 40))] for _ in range(num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prefix-len", type=int, default=70, help="shared system prefix tokens")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="a checkpoint directory or a named model (default: built-in)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    began = time.perf_counter()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = token_prompts(args.prompts, args.prefix_len)

    def make(**options) -> LLM:
        return LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=256 << 20, log_stats=False, **options)

    def run(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
        return [out.token_ids for out in llm.generate(batch, greedy, use_tqdm=False)]

    baseline = run(make(enable_prefix_caching=False), prompts)
    outputs: dict[str, list[list[int]]] = {}
    cached = make()
    outputs["cache on, cold"] = run(cached, prompts)
    outputs["cache on, warm"] = run(cached, prompts)
    fresh = make()
    outputs["one then the rest"] = run(fresh, prompts[:1]) + run(fresh, prompts[1:])
    chunked = make(max_num_batched_tokens=45)
    outputs["chunks of 45, cold"] = run(chunked, prompts)
    outputs["chunks of 45, warm"] = run(chunked, prompts)
    outputs["cache off, again"] = run(make(enable_prefix_caching=False), prompts)

    agreement = {}
    print(
        f"{args.dtype}: {args.prompts} prompts, {args.prefix_len}-token shared prefix, "
        f"{args.max_tokens} greedy tokens; identical requests vs caching off"
    )
    for name, got in outputs.items():
        same = sum(a == b for a, b in zip(got, baseline))
        agreement[name] = same / len(baseline)
        print(f"  {name:<22} {same:3d}/{len(baseline)}  {100 * same / len(baseline):5.1f}%")
    print(f"{time.perf_counter() - began:.1f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "prompts": args.prompts,
                "prefix_len": args.prefix_len,
                "max_tokens": args.max_tokens,
                "agreement": agreement,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
