"""Measure what this engine spends per prefill token, per attention pair and per decode step.

`prefixserve simulate --calibrate costs.json` writes the result as the fleet
simulator's cost model, so a simulated fleet runs at this machine's speed.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from tqdm import tqdm

from ...config import EngineConfig
from ..assembly import build_engine
from ..engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

SHORT, LONG = 512, 2048  # two prompt lengths separate the linear and the quadratic (attention) terms
DECODE_BATCH = 16
DECODE_STEPS = 32
STEPS = (
    "loading the model",
    "warming up",
    "timing the per-request overhead",
    f"timing {SHORT}-token prefills",
    f"timing {LONG}-token prefills",
    f"timing a decode batch of {DECODE_BATCH} x {DECODE_STEPS} tokens",
)

logger = logging.getLogger("prefixserve.calibrate")


class _StepProgress:
    """A bar over STEPS on a terminal; in a log file or a pipe one log line a step instead of redraws."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = tqdm(total=len(STEPS), desc="calibrating", unit="step", disable=None if enabled else True)
        self.num_started = 0

    def begin(self, step: str) -> None:
        assert step == STEPS[self.num_started], f"calibration step {step!r} is not in STEPS order"
        if self.num_started:
            self.bar.update()
        self.num_started += 1
        if not self.bar.disable:
            self.bar.set_postfix_str(step)
        elif self.enabled:
            logger.info("calibrating (%d/%d): %s ...", self.num_started, len(STEPS), step)

    def close(self) -> None:
        self.bar.update(len(STEPS) - self.bar.n)
        self.bar.close()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    request_ids = [engine.add_request(prompt, params).request_id for prompt in prompts]
    return engine.run_until_finished(request_ids)


def _median_ttft(engine: LLMEngine, length: int, rng: random.Random, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        engine.cache.clear()
        out = _generate(engine, [_tokens(rng, length)], SamplingParams(max_tokens=1, temperature=0.0))[0]
        times.append(out.metrics.ttft)
    return statistics.median(times)


def measure_costs(progress: bool = False, **engine_options: Any) -> dict[str, float | str]:
    """CostModel fields for the built-in model (or `model=`) on this machine; `progress` reports each step."""
    options = {"kv_cache_memory_bytes": 256 << 20, "max_num_batched_tokens": LONG, "log_stats": False, **engine_options}
    steps = _StepProgress(progress)
    steps.begin(STEPS[0])
    engine = build_engine(EngineConfig.from_kwargs(**options))
    rng = random.Random(0)
    steps.begin(STEPS[1])
    _median_ttft(engine, 64, rng, repeats=1)
    steps.begin(STEPS[2])
    overhead = _median_ttft(engine, 16, rng)
    steps.begin(STEPS[3])
    short = _median_ttft(engine, SHORT, rng)
    steps.begin(STEPS[4])
    long = _median_ttft(engine, LONG, rng)
    # t(n) = overhead + a n + b n^2 / 2: two lengths give a and b.
    ts, tl = short - overhead, long - overhead
    pair = max(2 * (tl * SHORT - ts * LONG) / (SHORT * LONG * (LONG - SHORT)), 0.0)
    per_token = max((ts - pair * SHORT * SHORT / 2) / SHORT, 1e-9)
    prompts = [_tokens(rng, 32) for _ in range(DECODE_BATCH)]
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)
    steps.begin(STEPS[5])
    start = time.perf_counter()
    outs = _generate(engine, prompts, params)
    elapsed = time.perf_counter() - start
    prefill_share = max(out.metrics.ttft for out in outs)
    step = max((elapsed - prefill_share) / (DECODE_STEPS - 1), 1e-6)
    steps.close()
    return {
        "prefill_seconds_per_token": per_token,
        "attention_seconds_per_token_pair": pair,
        "decode_seconds_per_token": step,
        "decode_batch_size": float(DECODE_BATCH),
        "overhead_seconds": overhead,
        "description": f"calibrated: {engine.version.name}, {engine.dtype} on {engine.device}, "
        f"{time.strftime('%Y-%m-%d')}",
    }
