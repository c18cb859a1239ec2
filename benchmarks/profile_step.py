"""Where one engine step's time goes: per-step wall times and a torch.profiler table per chosen step.

    python benchmarks/profile_step.py [--dtype bfloat16] [--workload system-prompt] [--steps 0,1,8]
                                      [--rows 20] [--no-prefix-caching] [--model smollm2-135m-instruct]
                                      [--dequantize]

Submits the first round of a workload (benchmarks/workloads.py) to one engine, steps it to the
end, prints every step's wall time with its batch (prompt tokens computed, tokens out), then for each chosen
step the operators by self CPU time (the compiled kernels as prefixserve::<name>: torch.profiler
does not see pybind functions, so this script names each call). Prints only; nothing is saved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import build_workloads  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.model import kernels  # noqa: E402


class NamedKernels:
    """The compiled module, each call inside record_function("prefixserve::<name>") so that the
    profiler's table has a row for it (a few microseconds a call: this script only)."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled

    def __getattr__(self, name: str):
        function = getattr(self.compiled, name)
        if not callable(function):  # variant, lanes, has_rowwise, ...
            return function

        def named(*args):
            with record_function(f"prefixserve::{name}"):
                return function(*args)

        return named


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="system-prompt", choices=list(build_workloads()))
    parser.add_argument("--steps", default="0,1,8", help="steps to profile, counted from 0")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory, .gguf file (served quantized) or model name; default: the built-in one",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="serve a .gguf's weights decoded to --dtype instead of its own quantized blocks",
    )
    args = parser.parse_args()
    profiled = {int(step) for step in args.steps.split(",") if step}
    if kernels.compiled is not None:
        kernels.compiled = NamedKernels(kernels.compiled)

    model = () if args.model is None else (args.model,)
    llm = LLM(
        *model,
        dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        log_stats=False,
        dequantize=args.dequantize,
    )
    llm.generate([[5] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    llm.engine.cache.clear()
    engine = llm.engine
    for turn in build_workloads()[args.workload].next_round(0, []):
        engine.add_request(
            turn.prompt_token_ids, SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
        )
    tables, walls = {}, []
    step = 0
    total = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilled, generated = engine.num_prefill_tokens_computed, engine.num_generation_tokens
        start = time.perf_counter()
        if step in profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            tables[step] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        else:
            engine.step()
        wall = time.perf_counter() - start
        walls.append(wall)
        print(
            f"step {step:>3}: {wall * 1e3:8.1f} ms  {engine.num_prefill_tokens_computed - prefilled:>5} prompt tokens, "
            f"{engine.num_generation_tokens - generated:>3} tokens out" + ("  (profiled)" if step in profiled else "")
        )
        step += 1
    print(
        f"{step} steps, {time.perf_counter() - total:.2f} s"
        + (f"; steps 1-{step - 1}: {statistics.median(walls[1:]) * 1e3:.1f} ms median" if step > 2 else "")
    )
    for step, table in tables.items():
        print(f"\n== step {step} ({args.workload}, {args.dtype}) ==\n{table}")


if __name__ == "__main__":
    main()
