"""What LoRA adapters cost a decode step (a batch of 32 decodes on the base, then with 8 adapters in it), and
what the cache saves under an adapter (the time to first token of a prompt sharing a long system prompt).

    python benchmarks/lora_step.py [--model HF_DIR] [--adapters 8] [--batch 32] [--runs 3]

Random PEFT adapters (rank 16, every projection) are written to a temporary directory; each run times the decode
of `--batch` requests (the engine's own step clock: time from first to last output, over the tokens after the
first) on the base, then with the batch spread evenly over `--adapters` adapters. Prints the per-step times and
their ratio (the issue's goal: 8 adapters in a batch of 32 cost at most 1.3x the base's step); then, under one
adapter, the time to first token of a fresh `--system-tokens` system prompt plus a question, and of the same
system prompt with another question (a hit: the goal is at most 0.2x). Saves benchmarks/results/lora_step.json.
Name the CPU with the figures: they are timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_adapters(model_dir: str, count: int, rank: int, directory: Path) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = []
    for index in range(count):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        )
        path = directory / f"adapter{index}"
        model.save_pretrained(str(path))
        paths.append(str(path))
    return paths


def decode_seconds_per_step(llm, prompts, lora_requests, num_tokens: int) -> float:
    from prefixserve import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False, lora_request=lora_requests)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    return (time.perf_counter() - start) / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: the built-in model)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1500)
    args = parser.parse_args()

    from prefixserve import LLM, LoRARequest
    from prefixserve.model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_adapters(model_dir, args.adapters, args.rank, Path(scratch))
        llm = LLM(model=model_dir, enable_lora=True, max_loras=args.adapters, max_num_seqs=args.batch, dtype="float32")
        prompts = [f"Request {index}: tell me about the number {index * 7}." for index in range(args.batch)]
        adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(paths)]
        spread = [adapters[index % len(adapters)] for index in range(args.batch)]
        rows = []
        for run in range(args.runs):
            base = decode_seconds_per_step(llm, prompts, None, args.tokens)
            adapted = decode_seconds_per_step(llm, prompts, spread, args.tokens)
            rows.append({"run": run, "base_ms": 1e3 * base, "adapters_ms": 1e3 * adapted, "ratio": adapted / base})
            print(
                f"run {run}: base {1e3 * base:7.2f} ms/step  {args.adapters} adapters {1e3 * adapted:7.2f} ms/step"
                f"  ratio {adapted / base:.2f}x",
                flush=True,
            )
        ttfts = [first_token_seconds(llm, adapters[0], run, args.system_tokens) for run in range(args.runs)]
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"median ratio, {args.adapters} adapters in a batch of {args.batch}: {ratio:.2f}x the base's decode step")
    for cold, warm in ttfts:
        print(
            f"under one adapter, {args.system_tokens}-token system prompt: TTFT cold {1e3 * cold:7.1f} ms, "
            f"hit {1e3 * warm:6.1f} ms ({warm / cold:.2f}x)"
        )
    RESULTS.mkdir(exist_ok=True)
    report = {"args": vars(args), "rows": rows, "ttft": [{"cold_s": c, "hit_s": w} for c, w in ttfts]}
    (RESULTS / "lora_step.json").write_text(json.dumps(report, indent=1))


def first_token_seconds(llm, lora_request, seed: int, system_tokens: int) -> tuple[float, float]:
    """(TTFT of a new system prompt + question, TTFT of the same system prompt + another question) under
    `lora_request`: one-token generations, timed whole."""
    import random

    from prefixserve import SamplingParams

    rng = random.Random(1000 + seed)
    system = [rng.randrange(5, 4000) for _ in range(system_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for _ in range(2):
        prompt = system + [rng.randrange(5, 4000) for _ in range(24)]
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)
        times.append(time.perf_counter() - start)
    return times[0], times[1]


if __name__ == "__main__":
    sys.exit(main())
