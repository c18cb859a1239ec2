"""What benchmarks/tiers.py measures with: sizes, engines, one timed request, one timed fetch, the vLLM peer."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

EVERYTHING = 1 << 30  # "evict this many blocks": every unreferenced one
FIRST_ORDINARY_ID = 4  # 0-3 are the built-in model's special tokens
VOCAB_SIZE = 8192
VLLM_TIMEOUT_S = 900


@dataclass(frozen=True)
class Sizes:
    ladder_prefix: int = 2000  # tokens of the prefix the ladder and the restart section bring back
    suffix: int = 16  # new tokens after it
    repeats: int = 3  # medians over this many prefixes
    num_prefixes: int = 24  # the working set
    working_prefix: int = 1000
    working_suffix: int = 20
    max_tokens: int = 4
    passes: int = 2
    pool_prompts: int = 3  # whole working-set prompts (with their output) the device pool holds
    host_small_prompts: int = 8  # ... and the host tier of the host + disk configuration
    quick: bool = False


def random_tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(length)]


@functools.lru_cache(maxsize=None)
def kv_bytes_per_token(dtype: str) -> int:
    """The built-in model's K and V of every layer for one token."""
    from prefixserve.model import ModelConfig, ensure_default_model
    from prefixserve.model.weights.hf_loader import read_config_dict
    from prefixserve.plan.tiers import kv_bytes_per_token as per_token

    config = ModelConfig.from_hf_dict(read_config_dict(ensure_default_model()))
    return per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype)


def engine(dtype: str, kv_cache_memory_bytes: int, warm: bool = True, **options):
    """The built-in model with a pool of exactly this many bytes, warmed up once (nothing left cached).

    Every lower-tier hit is fetched (kv_fetch_policy="always"): these tables measure what each tier costs
    when it serves, so the planner must not swap a slow read for a recompute (it would at --quick sizes)."""
    from prefixserve import LLM

    options.setdefault("kv_fetch_policy", "always")
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes, log_stats=False, **options)
    if warm:
        warm_up(llm)
    return llm


def warm_up(llm) -> None:
    from prefixserve import SamplingParams

    llm.generate(
        [random_tokens(random.Random("warm-up"), 64)], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    llm.engine.cache.clear()


def ttft(llm, prompt: list[int], served: dict, name: str) -> float:
    """TTFT of a one-token greedy request; `served[name]` keeps where its cached tokens came from."""
    from prefixserve import SamplingParams

    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if name:
        served[name] = out.cached_tokens_by_tier
    return out.metrics.ttft


def drop_page_cache(directory: Path) -> None:
    """Make the next read of each record come from the device: fsynced pages are clean, so DONTNEED drops them."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fetch_seconds(llm, source: str, prompt: list[int], num_blocks: int, directory: Path) -> float:
    """Bring back the first `num_blocks` of `prompt` as the engine does: the radix match on the device; from a
    tier, read, check each record, take fresh pool blocks and copy the KV in (the radix insert is left out)."""
    from prefixserve.tiers import RecordExpectation, decode_record

    engine_ = llm.engine
    request = engine_.make_request(prompt)
    keys = engine_.keyer.keys(request.scope_digest, prompt)[:num_blocks]
    if source == "device":
        start = time.perf_counter()
        hit = engine_.cache.match(request.scope_digest, keys, prompt, record_stats=False).blocks
        seconds = time.perf_counter() - start
        assert len(hit) == num_blocks, f"the prefix left the pool ({len(hit)} of {num_blocks} blocks)"
        return seconds
    tiers, size = engine_.tiers, engine_.config.block_size
    tier = tiers["host"] if source == "host" else tiers["disk"]
    if source == "disk cold":
        drop_page_cache(directory)
    start = time.perf_counter()
    payloads = []
    for index, (key, data) in enumerate(zip(keys, tier.get(keys))):
        assert data is not None, f"block {index} is not in the {source} tier"
        expect = RecordExpectation(
            key,
            tiers.context.scope_digest,
            tuple(prompt[index * size : (index + 1) * size]),
            tiers.context.dtype,
            tiers.context.shape,
        )
        payloads.append(decode_record(data, expect).payload)
    blocks = engine_.cache.admit([], num_blocks)
    engine_.runner.write_blocks([block.block_id for block in blocks], payloads)
    seconds = time.perf_counter() - start
    engine_.cache.release(blocks)
    return seconds


def run_vllm(python: str, passes: list[list[list[int]]], max_tokens: int, submit: str, engine_args: dict) -> dict:
    """The working set through vLLM's CPU build (benchmarks/tiers_vllm_peer.py in its own venv), on every core."""
    from prefixserve.model import ensure_default_model

    if not Path(python).exists():
        raise RuntimeError(f"vLLM not installed ({python} missing; see benchmarks/vllm_peer.py)")
    task = {
        "model": str(ensure_default_model()),
        "dtype": "float32",
        "passes": passes,
        "max_tokens": max_tokens,
        "submit": submit,
        "engine": engine_args,
    }
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    with tempfile.TemporaryDirectory(prefix="tiers-vllm-") as tmp:
        task_path, result_path, log_path = Path(tmp, "task.json"), Path(tmp, "result.json"), Path(tmp, "vllm.log")
        task_path.write_text(json.dumps(task))
        code: Optional[int] = None
        with open(log_path, "w") as log:
            peer = subprocess.Popen(
                [python, str(Path(__file__).with_name("tiers_vllm_peer.py")), str(task_path), str(result_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                code = peer.wait(timeout=VLLM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # vLLM's engine and worker processes must not outlive it and steal the next engine's cores
            os.killpg(peer.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code != 0 or not result_path.exists():
            reason = f"timed out after {VLLM_TIMEOUT_S} s" if code is None else f"exited with {code}"
            raise RuntimeError(f"the vLLM peer {reason}; its log ends with:\n{log_path.read_text()[-3000:]}")
        return json.loads(result_path.read_text())
