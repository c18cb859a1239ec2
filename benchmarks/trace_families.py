"""kv_aware against the best other policy on random agent-trace shapes, at three loads (simulated, 8 replicas).

    python benchmarks/trace_families.py [--seeds 0-39] [--loads 0.1,0.3,0.6] [--replicas 8] [--no-plot]

Each seed draws one shape from wide knob ranges (traces/agents.py: sessions, turns, system prompts and
their skew, tool-schema, task, tool-result and output lengths, gaps and think times of every
distribution), then scales its sessions to each load: the trace's uncached utilization (the share of
the fleet's prefill time it would take with no prefix cache). For every point it prints kv_aware's hit
rate and TTFT p99 beside the best other policy's and marks a miss (hit rate more than half a point
below, or TTFT p99 more than 5% above); writes benchmarks/results/trace_families.{json,png}. Runs on
the CPU in a few minutes; the figures are deterministic (simulated seconds, not this machine's).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from prefixserve.cli import HelpFormatter
from prefixserve.traces.agents import GAP_DISTRIBUTIONS, AgentTraceConfig, generate_agent_trace
from prefixserve.router.policies import POLICIES
from prefixserve.router.report import BOUND_NAME
from prefixserve.router.simulate import SimulationConfig, compare_policies, uncached_utilization

ROOT = Path(__file__).resolve().parent
HIT_RATE_POINTS, TTFT_P99_RATIO = 0.005, 1.05
MAX_REQUESTS = 12000  # a shape whose load needs more is skipped (and said so): it would take minutes


def _range(rng: random.Random, low: int, high: int) -> tuple[int, int]:
    first, second = rng.randint(low, high), rng.randint(low, high)
    return min(first, second), max(first, second)


def random_shape(seed: int) -> AgentTraceConfig:
    rng = random.Random(seed)
    return AgentTraceConfig(
        seed=seed, num_sessions=rng.choice([40, 80, 160, 320]), num_system_prompts=rng.choice([1, 2, 4, 8, 16, 64]),
        system_prompt_tokens=_range(rng, 200, 8000), system_prompt_skew=rng.choice([0, 0, 0.8, 1.5, 2.5]),
        tool_schema_tokens=rng.choice([0, 500, 2500, 6000]), task_tokens=_range(rng, 20, 3000),
        turns=_range(rng, 1, 40), tool_result_tokens=_range(rng, 0, 5000), output_tokens=_range(rng, 5, 3000),
        turn_gap_seconds=rng.choice([0.5, 2, 4]), think_time_mean_seconds=rng.choice([0.5, 3, 8, 30]),
        think_times=rng.choice(GAP_DISTRIBUTIONS), session_gaps=rng.choice(GAP_DISTRIBUTIONS))


def _seeds(text: str) -> range:
    low, dash, high = text.partition("-")
    return range(int(low), int(high) + 1) if dash else range(int(low), int(low) + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--seeds", default="0-39", help="shape seeds, LOW-HIGH inclusive")
    parser.add_argument("--loads", default="0.1,0.3,0.6", help="uncached utilizations, comma-separated")
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for the JSON and PNG results")
    args = parser.parse_args()
    loads = [float(part) for part in args.loads.split(",")]
    config = SimulationConfig(num_replicas=args.replicas)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    points = []
    for seed in _seeds(args.seeds):
        shape = random_shape(seed)
        utilization = uncached_utilization(generate_agent_trace(shape), config)
        for load in loads:
            trace = generate_agent_trace(shape.at_load(load / utilization))
            if not 50 <= len(trace) <= MAX_REQUESTS:
                print(f"seed {seed:3d} load {load}: skipped, {len(trace)} requests (outside 50-{MAX_REQUESTS})")
                continue
            results = {r.policy: r for r in compare_policies(trace, list(POLICIES), config)}
            kv_aware = results["kv_aware"]
            others = [r for name, r in results.items() if name not in ("kv_aware", BOUND_NAME)]
            best_hit = max(others, key=lambda r: r.hit_rate)
            best_p99 = min(others, key=lambda r: r.ttft_p99)
            point = {"seed": seed, "load": load, "requests": len(trace), "shape": shape.describe(),
                     "kv_aware_hit_rate": kv_aware.hit_rate, "kv_aware_ttft_p99": kv_aware.ttft_p99,
                     "best_hit_rate": best_hit.hit_rate, "best_hit_policy": best_hit.policy,
                     "best_ttft_p99": best_p99.ttft_p99, "best_p99_policy": best_p99.policy,
                     "hit_miss": kv_aware.hit_rate < best_hit.hit_rate - HIT_RATE_POINTS,
                     "p99_miss": kv_aware.ttft_p99 > best_p99.ttft_p99 * TTFT_P99_RATIO}
            points.append(point)
            mark = " ".join(name for name, missed in (("HIT", point["hit_miss"]), ("P99", point["p99_miss"])) if missed)
            print(f"seed {seed:3d} load {load:<4} {len(trace):6,d} req  kv_aware {kv_aware.hit_rate:6.1%} "
                  f"{kv_aware.ttft_p99:8.3f} s | best {best_hit.hit_rate:6.1%} ({best_hit.policy:15s}) "
                  f"{best_p99.ttft_p99:8.3f} s ({best_p99.policy:15s}) p99 ratio "
                  f"{kv_aware.ttft_p99 / best_p99.ttft_p99:5.2f} {mark}", flush=True)
    misses = [p for p in points if p["hit_miss"] or p["p99_miss"]]
    print(f"{len(points)} points, {len(misses)} missed ({sum(p['hit_miss'] for p in points)} on hit rate, "
          f"{sum(p['p99_miss'] for p in points)} on TTFT p99), {time.perf_counter() - began:.0f} s")
    for point in misses:
        print(f"  missed: seed {point['seed']} load {point['load']}: {point['shape']}")
    (out / "trace_families.json").write_text(json.dumps(points, indent=2) + "\n")
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
        hits.scatter([p["best_hit_rate"] * 100 for p in chosen],
                     [(p["kv_aware_hit_rate"] - p["best_hit_rate"]) * 100 for p in chosen],
                     marker=marker, label=f"load {load}", alpha=0.7)
        p99s.scatter([p["best_ttft_p99"] for p in chosen], [p["kv_aware_ttft_p99"] / p["best_ttft_p99"] for p in chosen],
                     marker=marker, label=f"load {load}", alpha=0.7)
    hits.axhline(-HIT_RATE_POINTS * 100, color="red", linewidth=0.8, linestyle="--")
    hits.set(xlabel="best other policy's hit rate (%)", ylabel="kv_aware minus best (points)",
             title="hit rate (above the line: within 0.5 pt)")
    p99s.axhline(TTFT_P99_RATIO, color="red", linewidth=0.8, linestyle="--")
    p99s.set(xscale="log", yscale="log", xlabel="best other policy's TTFT p99 (s)", ylabel="kv_aware / best",
             title="TTFT p99 (below the line: within 5%)")
    hits.legend()
    figure.suptitle(f"kv_aware against the best other policy on {len(points)} random agent-trace shapes x loads")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


if __name__ == "__main__":
    main()
