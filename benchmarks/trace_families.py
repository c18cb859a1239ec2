"""kv_aware against the best other policy on random agent-trace shapes, at three loads (simulated, 8 replicas).

    python benchmarks/trace_families.py [--seeds 0-199] [--loads 0.1,0.4,0.8] [--replicas 8] [--jobs 2] [--no-plot]

Each seed draws one shape from wide knob ranges (random_shape: sessions, turns, system prompts and
their skew, tool-schema, task, tool-result and output lengths, gaps and think times of every
distribution, the model's context), sizes its sessions so its lightest load gives 300-2,500 requests,
then scales them to each load: the trace's uncached utilization (the share of the fleet's prefill time
it would take with no prefix cache). The other policies are ours and the gateways' scorers
(gateway_policies.py). For every point it prints kv_aware's hit rate and TTFT p99 beside the best other
policy's and marks a miss (hit rate more than half a point below, or TTFT p99 more than 5% above);
writes benchmarks/results/trace_families.{json,png}. About 10 minutes on 2 cores with --jobs 2; the
figures are deterministic (simulated seconds, not this machine's).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import random
import time
from dataclasses import replace
from pathlib import Path

from prefixserve.cli import HelpFormatter
from prefixserve.router.gateway_policies import GATEWAY_POLICIES
from prefixserve.router.policies import POLICIES
from prefixserve.simulator.replay import SimulationConfig, compare_policies, uncached_utilization
from prefixserve.simulator.report import BOUND_NAME
from prefixserve.traces.agents import GAP_DISTRIBUTIONS, AgentTraceConfig, generate_agent_trace

ROOT = Path(__file__).resolve().parent
HIT_RATE_POINTS, TTFT_P99_RATIO = 0.005, 1.05
MAX_REQUESTS = 25000  # a point that still needs more after sizing is skipped (and said so): it would take minutes
# A shape's sessions are scaled (at its own session rate, so its load stays) until its trace at the lowest load
# has this many requests: enough for a p99 to mean something, few enough that the highest load stays under
# MAX_REQUESTS.
LOWEST_LOAD_REQUESTS = (300, 2500)
COMPARED = (*POLICIES, *GATEWAY_POLICIES)  # ours and the gateways' scorers


def _range(rng: random.Random, low: int, high: int) -> tuple[int, int]:
    first, second = rng.randint(low, high), rng.randint(low, high)
    return min(first, second), max(first, second)


def random_shape(seed: int) -> AgentTraceConfig:
    """One shape from wide ranges of every knob: from a chat of one turn to agent sessions of 80, system prompts
    of 100 to 16,000 tokens shared by 1 to 256 kinds of session (Zipf skew 0 to 3.5), tool schemas up to
    12,000 tokens, tool results up to 10,000, answers up to 4,000, every gap distribution, and a model
    context of 32k, 64k or 128k tokens that ends a session."""
    rng = random.Random(seed)
    return AgentTraceConfig(
        seed=seed,
        num_sessions=rng.choice([20, 40, 80, 160, 320, 640]),
        num_system_prompts=rng.choice([1, 2, 4, 8, 16, 64, 256]),
        system_prompt_tokens=_range(rng, 100, 16000),
        system_prompt_skew=rng.choice([0, 0, 0.5, 0.8, 1.5, 2.5, 3.5]),
        tool_schema_tokens=rng.choice([0, 500, 2500, 6000, 12000]),
        task_tokens=_range(rng, 10, 6000),
        turns=_range(rng, 1, rng.choice([3, 40, 80])),
        tool_result_tokens=_range(rng, 0, 10000),
        output_tokens=_range(rng, 1, 4000),
        turn_gap_seconds=rng.choice([0.25, 0.5, 2, 4, 8]),
        think_time_mean_seconds=rng.choice([0, 0.5, 3, 8, 30, 120]),
        max_prompt_tokens=rng.choice([32768, 65536, 131072]),
        think_times=rng.choice(GAP_DISTRIBUTIONS),
        session_gaps=rng.choice(GAP_DISTRIBUTIONS),
    )


def sized(shape: AgentTraceConfig, config: SimulationConfig, lowest_load: float) -> AgentTraceConfig:
    """The shape with as many sessions (started at its own rate) as give LOWEST_LOAD_REQUESTS at the lowest load."""
    trace = generate_agent_trace(shape)
    at_lowest = len(trace) * lowest_load / uncached_utilization(trace, config)
    low, high = LOWEST_LOAD_REQUESTS
    if low <= at_lowest <= high:
        return shape
    factor = (low if at_lowest < low else high) / max(at_lowest, 1.0)
    return replace(shape, num_sessions=max(1, round(shape.num_sessions * factor)))


def _seeds(text: str) -> range:
    low, dash, high = text.partition("-")
    return range(int(low), int(high) + 1) if dash else range(int(low), int(low) + 1)


def run_shape(seed: int, loads: tuple[float, ...], num_replicas: int) -> list[dict]:
    """One shape at every load: a point per load (None for a load whose trace is out of bounds)."""
    config = SimulationConfig(num_replicas=num_replicas)
    shape = sized(random_shape(seed), config, min(loads))
    utilization = uncached_utilization(generate_agent_trace(shape), config)
    points = []
    for load in loads:
        trace = generate_agent_trace(shape.at_load(load / utilization))
        point = {"seed": seed, "load": load, "requests": len(trace), "shape": shape.describe()}
        if not 50 <= len(trace) <= MAX_REQUESTS:
            points.append({**point, "skipped": True})
            continue
        results = {r.policy: r for r in compare_policies(trace, list(COMPARED), config)}
        kv_aware = results["kv_aware"]
        others = [r for name, r in results.items() if name not in ("kv_aware", BOUND_NAME)]
        best_hit = max(others, key=lambda r: r.hit_rate)
        best_p99 = min(others, key=lambda r: r.ttft_p99)
        points.append(
            {
                **point,
                "skipped": False,
                "kv_aware_hit_rate": kv_aware.hit_rate,
                "kv_aware_ttft_p99": kv_aware.ttft_p99,
                "best_hit_rate": best_hit.hit_rate,
                "best_hit_policy": best_hit.policy,
                "best_ttft_p99": best_p99.ttft_p99,
                "best_p99_policy": best_p99.policy,
                "hit_miss": kv_aware.hit_rate < best_hit.hit_rate - HIT_RATE_POINTS,
                "p99_miss": kv_aware.ttft_p99 > best_p99.ttft_p99 * TTFT_P99_RATIO,
            }
        )
    return points


def _line(point: dict) -> str:
    head = f"seed {point['seed']:3d} load {point['load']:<4} {point['requests']:6,d} req"
    if point["skipped"]:
        return f"{head}  skipped (outside 50-{MAX_REQUESTS} requests)"
    mark = " ".join(name for name, missed in (("HIT", point["hit_miss"]), ("P99", point["p99_miss"])) if missed)
    return (
        f"{head}  kv_aware {point['kv_aware_hit_rate']:6.1%} {point['kv_aware_ttft_p99']:8.3f} s | best "
        f"{point['best_hit_rate']:6.1%} ({point['best_hit_policy']:23s}) {point['best_ttft_p99']:8.3f} s "
        f"({point['best_p99_policy']:23s}) p99 ratio {point['kv_aware_ttft_p99'] / point['best_ttft_p99']:5.2f} "
        f"{mark}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, formatter_class=HelpFormatter
    )
    parser.add_argument("--seeds", default="0-199", help="shape seeds, LOW-HIGH inclusive")
    parser.add_argument("--loads", default="0.1,0.4,0.8", help="uncached utilizations, comma-separated")
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas")
    parser.add_argument("--jobs", type=int, default=1, help="shapes simulated at once (processes)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for the JSON and PNG results")
    args = parser.parse_args()
    loads = tuple(float(part) for part in args.loads.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    every = []
    work = functools.partial(run_shape, loads=loads, num_replicas=args.replicas)
    with multiprocessing.Pool(args.jobs) as pool:
        for shape_points in pool.imap(work, _seeds(args.seeds)):
            for point in shape_points:
                print(_line(point), flush=True)
            every.extend(shape_points)
    points = [p for p in every if not p["skipped"]]
    misses = [p for p in points if p["hit_miss"] or p["p99_miss"]]
    print(
        f"{len(points)} points ({len(every) - len(points)} skipped), {len(misses)} missed "
        f"({sum(p['hit_miss'] for p in points)} on hit rate, {sum(p['p99_miss'] for p in points)} on TTFT p99), "
        f"{time.perf_counter() - began:.0f} s"
    )
    for point in misses:
        print(f"  missed: seed {point['seed']} load {point['load']}: {point['shape']}")
    (out / "trace_families.json").write_text(json.dumps(every, indent=2) + "\n")
    written = [out / "trace_families.json"]
    if not args.no_plot and points:
        written.append(_plot(points, out / "trace_families.png"))
    print("wrote " + ", ".join(str(path) for path in written))


def _plot(points: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (hits, p99s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for load, marker in zip(sorted({p["load"] for p in points}), "os^vD"):
        chosen = [p for p in points if p["load"] == load]
        hits.scatter(
            [p["best_hit_rate"] * 100 for p in chosen],
            [(p["kv_aware_hit_rate"] - p["best_hit_rate"]) * 100 for p in chosen],
            marker=marker,
            label=f"load {load}",
            alpha=0.7,
        )
        p99s.scatter(
            [p["best_ttft_p99"] for p in chosen],
            [p["kv_aware_ttft_p99"] / p["best_ttft_p99"] for p in chosen],
            marker=marker,
            label=f"load {load}",
            alpha=0.7,
        )
    hits.axhline(-HIT_RATE_POINTS * 100, color="red", linewidth=0.8, linestyle="--")
    hits.set(
        xlabel="best other policy's hit rate (%)",
        ylabel="kv_aware minus best (points)",
        title="hit rate (above the line: within 0.5 pt)",
    )
    p99s.axhline(TTFT_P99_RATIO, color="red", linewidth=0.8, linestyle="--")
    p99s.set(
        xscale="log",
        yscale="log",
        xlabel="best other policy's TTFT p99 (s)",
        ylabel="kv_aware / best",
        title="TTFT p99 (below the line: within 5%)",
    )
    hits.legend()
    figure.suptitle(f"kv_aware against the best other policy on {len(points)} random agent-trace shapes x loads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    main()
