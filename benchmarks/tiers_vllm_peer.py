"""Runs benchmarks/tiers.py's working-set workload through vLLM's offline `LLM`; in vLLM's own venv.

    /tmp/vllm-peer/bin/python benchmarks/tiers_vllm_peer.py TASK.json RESULT.json

TASK.json: {"model": DIR, "dtype", "passes": [[prompt token ids, ...], ...], "max_tokens", "submit": "sequential"
            | "batch", "engine": {vLLM LLM keyword arguments, e.g. kv_cache_memory_bytes, max_model_len}}
RESULT.json: {"version", "load_s", "block_size", "passes": [{"wall_s", "completions": [{output_token_ids, ttft,
              num_cached_tokens}]}]}

Imports nothing from prefixserve (not installed in vLLM's venv); vllm_peer.py's generate adapter is shared.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_peer import make_generate  # noqa: E402
from workloads import Turn, random_tokens  # noqa: E402


def main() -> None:
    task = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams, __version__

    start = time.perf_counter()
    llm = LLM(
        model=task["model"],
        dtype=task["dtype"],
        enable_prefix_caching=True,
        seed=0,
        disable_log_stats=False,
        **task.get("engine", {}),
    )
    load_s = time.perf_counter() - start
    generate = make_generate(llm, SamplingParams)
    generate([Turn(random_tokens(random.Random("warm-up"), 64), 4)])
    llm.reset_prefix_cache()
    passes = []
    for prompts in task["passes"]:
        turns = [Turn(prompt, task["max_tokens"]) for prompt in prompts]
        start = time.perf_counter()
        if task["submit"] == "batch":
            completions = generate(turns)
        else:
            completions = [generate([turn])[0] for turn in turns]
        passes.append(
            {"wall_s": time.perf_counter() - start, "completions": [asdict(completion) for completion in completions]}
        )
        print(f"vllm pass {len(passes)}: {passes[-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    Path(sys.argv[2]).write_text(
        json.dumps({"version": __version__, "load_s": load_s, "block_size": block_size, "passes": passes})
    )


if __name__ == "__main__":
    main()
