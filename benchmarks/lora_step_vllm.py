"""lora_step.py's decode measurement through vLLM's offline `LLM` API; run by lora_step.py --vllm in vLLM's venv.

    /tmp/vllm-peer/bin/python benchmarks/lora_step_vllm.py TASK_JSON

TASK_JSON (a string): {"model": DIR, "adapters": [PEFT dirs], "rank": 16, "prompts": [str], "tokens": 32,
"runs": 3}. One engine with LoRA enabled (max_loras = the number of adapters, max_lora_rank = rank, float32);
each run times a batch of the prompts on the base, then with adapter i % len(adapters) on prompt i (greedy,
ignore_eos, `tokens` tokens, wall time of generate over `tokens`, after a 2-token warm-up of the same batch).
Prints one JSON line last on stdout: {"version", "rows": [{"run", "base_ms", "adapters_ms", "ratio"}]}, or
{"version", "lora_error": the first line of the exception, "rows": base-only} where vLLM refuses LoRA and an
engine without it runs, or {"version", "error"} where that engine fails too. VLLM_CPU_KVCACHE_SPACE defaults
to 2 (GiB). Imports nothing from prefixserve.
"""

from __future__ import annotations

import json
import os
import sys
import time


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def seconds_per_step(llm, sampling_params_class, prompts, lora_requests, tokens: int) -> float:
    warm = sampling_params_class(max_tokens=2, ignore_eos=True)
    params = sampling_params_class(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False, lora_request=lora_requests)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    return (time.perf_counter() - start) / tokens


def main() -> None:
    task = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; by default vLLM asks for most of the memory
    from vllm import LLM, SamplingParams, __version__
    from vllm.lora.request import LoRARequest

    prompts, tokens = task["prompts"], task["tokens"]
    engine = dict(model=task["model"], dtype="float32", max_num_seqs=len(prompts), seed=0)
    result: dict = {"version": __version__, "rows": []}
    try:
        llm = LLM(**engine, enable_lora=True, max_loras=len(task["adapters"]), max_lora_rank=task["rank"])
        adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(task["adapters"])]
        spread = [adapters[index % len(adapters)] for index in range(len(prompts))]
        for run in range(task["runs"]):
            base = seconds_per_step(llm, SamplingParams, prompts, None, tokens)
            adapted = seconds_per_step(llm, SamplingParams, prompts, spread, tokens)
            result["rows"].append(
                {"run": run, "base_ms": 1e3 * base, "adapters_ms": 1e3 * adapted, "ratio": adapted / base}
            )
            print(f"vllm run {run}: base {1e3 * base:.2f} ms, adapters {1e3 * adapted:.2f} ms", file=sys.stderr)
    except Exception as error:  # vLLM's CPU build may refuse LoRA: say so, and time the base alone
        print(json.dumps({**result, "error": first_line(error)}), flush=True)  # if the base cannot run either
        result["lora_error"] = first_line(error)
        if not result["rows"]:
            llm = None  # the LoRA engine, where it started, goes first
            llm = LLM(**engine)
            for run in range(task["runs"]):
                base = seconds_per_step(llm, SamplingParams, prompts, None, tokens)
                result["rows"].append({"run": run, "base_ms": 1e3 * base, "adapters_ms": None, "ratio": None})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
