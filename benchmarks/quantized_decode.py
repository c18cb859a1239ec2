"""The real model's weights held as floats and held quantized, end to end through the engine.

    python benchmarks/quantized_decode.py [--model smollm2-135m-instruct] [--runs 3]

Formats: float32 and bfloat16 (--dequantize: the GGUF decoded, the exact path), the GGUF's own blocks
(SmolLM2's file: Q4_1 projections, a Q8_0 embedding), and --quantize int8 / int4 of the decoded weights.
Per format: resident weight memory, the weight bytes a decode step reads (the bandwidth a token costs at
batch 1), decode time per output token (TPOT) at batch 1 and 8, prefill tokens/s (one 1,024-token
prompt), and greedy agreement with float32 on 24 chat requests (the share of positions with the same
token; the first tokens are counted apart). Medians of --runs; the CPU is printed first.
Saves benchmarks/results/quantized_decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from quantized_matmul import cpu_name

from prefixserve import LLM, SamplingParams
from prefixserve.model import kernels
from prefixserve.model.weights.quantized_model import weight_memory

FORMATS = {
    "float32": dict(dequantize=True, dtype="float32"),
    "bfloat16": dict(dequantize=True, dtype="bfloat16"),
    "gguf": dict(),
    "int8": dict(quantize="int8"),
    "int4": dict(quantize="int4"),
}
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into French.",
    "Who wrote Romeo and Juliet?",
    "Name a planet with rings.",
    "Explain recursion in one sentence.",
    "What language is spoken in Brazil?",
    "Suggest a name for a cat.",
    "What do bees make?",
    "Name a primary color.",
    "What is photosynthesis?",
    "List three fruits.",
    "What is the tallest mountain?",
    "How do magnets work?",
    "Describe a rainbow.",
    "What is an atom?",
    "Why do we sleep?",
    "What is gravity?",
    "Name a famous painter.",
    "What is the speed of light?",
]
RESULTS = Path(__file__).resolve().parent / "results"


def decode_seconds_per_token(llm: LLM, batch: int, runs: int) -> float:
    """(time of 65 output tokens - time of 1) / 64, for `batch` requests of a 64-token prompt."""
    prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(64)] for i in range(batch)]

    def elapsed(max_tokens: int) -> float:
        began = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        return time.perf_counter() - began

    samples = [(elapsed(65) - elapsed(1)) / 64 for _ in range(runs)]
    return statistics.median(samples)


def prefill_tokens_per_second(llm: LLM, runs: int) -> float:
    samples = []
    for run in range(runs):
        prompt = [(run * 31 + 17 * j) % 5000 + 100 for j in range(1024)]  # another prompt each run: no hit
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        samples.append(1024 / (time.perf_counter() - began))
    return statistics.median(samples)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
    outputs = llm.chat(chats, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(output.token_ids) for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{cpu_name()}; kernels {kernels.variant()}")
    rows, reference = {}, None
    for name in args.formats.split(","):
        llm = LLM(args.model, kv_cache_memory_bytes=256 << 20, log_stats=False, **FORMATS[name])
        memory = weight_memory(llm.engine.version.model)
        tokens = greedy_tokens(llm)
        reference = reference if reference is not None else tokens  # the first format listed: float32
        agreeing = sum(a == b for mine, theirs in zip(tokens, reference) for a, b in zip(mine, theirs))
        rows[name] = {
            "resident_mib": memory.resident_bytes / 2**20,
            "decode_mb_per_token": memory.decode_bytes / 1e6,
            "kinds": memory.kinds,
            "tpot_ms_batch1": 1e3 * decode_seconds_per_token(llm, 1, args.runs),
            "tpot_ms_batch8": 1e3 * decode_seconds_per_token(llm, 8, args.runs),
            "prefill_tokens_per_second": prefill_tokens_per_second(llm, args.runs),
            "agreement": agreeing / sum(len(t) for t in reference),
            "first_tokens_agree": sum(mine[0] == theirs[0] for mine, theirs in zip(tokens, reference)),
        }
        del llm
        row = rows[name]
        print(
            f"{name:<9} {row['resident_mib']:7.1f} MiB  reads {row['decode_mb_per_token']:6.1f} MB/token  "
            f"TPOT {row['tpot_ms_batch1']:6.2f} ms (b1) {row['tpot_ms_batch8']:6.2f} ms (b8)  "
            f"prefill {row['prefill_tokens_per_second']:7.0f} tok/s  agrees {100 * row['agreement']:5.1f}% "
            f"(first tokens {row['first_tokens_agree']}/{len(QUESTIONS)})  [{', '.join(row['kinds'])}]",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quantized_decode.json").write_text(
        json.dumps({"cpu": cpu_name(), "kernels": kernels.variant(), "formats": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
