"""Routing policies on one hour of real chat traffic (Mooncake conversation trace) over 8 replicas.

    python benchmarks/simulate_fleet.py [--trace FILE] [--replicas 8] [--capacity-blocks 1000]
                                        [--costs costs.json] [--no-sweep] [--no-progress]

Prints the policy table and wall time, writes benchmarks/results/fleet_policies.{png,json}, and
(unless --no-sweep) the hit rate against cache size, fleet_policies_sweep.{png,json}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prefixserve.router.policies import POLICIES
from prefixserve.router.simulate import (
    CostModel, SimulationConfig, capacity_sweep, compare_policies, format_table, plot_capacity_sweep,
    plot_policies, prepare_routes, results_to_json,
)
from prefixserve.router.traces import load_mooncake

ROOT = Path(__file__).resolve().parent
TRACE_NAME = "data/traces/mooncake_conversation_trace.jsonl"
# shared/ sits inside the checkout on some machines and beside it on others.
DEFAULT_TRACE = next((p for p in (ROOT.parent / "shared" / TRACE_NAME, ROOT.parent.parent / "shared" / TRACE_NAME)
                      if p.is_file()), ROOT.parent / "shared" / TRACE_NAME)
SWEEP_CAPACITIES = (250, 500, 1000, 2000, 4000, 8000, 16000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--capacity-blocks", type=int, default=1000)
    parser.add_argument("--costs", help="cost model JSON; default: the built-in H100 estimate")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost = CostModel.load(args.costs) if args.costs else CostModel()
    config = SimulationConfig(args.replicas, args.capacity_blocks, cost, progress=not args.no_progress)
    began = time.perf_counter()
    trace = load_mooncake(args.trace)
    routes = prepare_routes(trace)
    loaded = time.perf_counter()
    results = compare_policies(trace, list(POLICIES), config, routes)
    replayed = time.perf_counter()
    print(f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s; {config.num_replicas} replicas x "
          f"{config.capacity_blocks} blocks of {trace.block_size} tokens")
    print(format_table(results))
    print(f"wall time: {loaded - began:.1f} s to load and key the trace, "
          f"{replayed - loaded:.1f} s to replay {len(POLICIES)} policies")
    (out / "fleet_policies.json").write_text(json.dumps(results_to_json(results), indent=2) + "\n")
    plot_policies(results, out / "fleet_policies.png", f"{trace.name}, {config.num_replicas} replicas, "
                  f"{config.capacity_blocks} blocks each")
    if args.no_sweep:
        return
    began = time.perf_counter()
    sweep = capacity_sweep(trace, list(POLICIES), SWEEP_CAPACITIES, config)
    print(f"\nhit rate vs capacity per replica ({time.perf_counter() - began:.1f} s)")
    names = [r.policy for r in sweep[SWEEP_CAPACITIES[0]]]
    print("blocks  " + "  ".join(f"{name:>20}" for name in names))
    for capacity, rows in sweep.items():
        print(f"{capacity:>6}  " + "  ".join(f"{r.hit_rate:>20.1%}" for r in rows))
    (out / "fleet_policies_sweep.json").write_text(
        json.dumps({str(c): results_to_json(rows) for c, rows in sweep.items()}, indent=2) + "\n")
    plot_capacity_sweep(sweep, out / "fleet_policies_sweep.png", f"{trace.name}, {config.num_replicas} replicas")


if __name__ == "__main__":
    main()
