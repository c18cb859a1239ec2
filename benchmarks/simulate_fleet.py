"""Routing policies on one hour of real chat traffic (Mooncake conversation trace) over 8 replicas.

    python benchmarks/simulate_fleet.py [--trace conversation] [--replicas 8] [--capacity-blocks 1000]
                                        [--costs costs.json] [--no-sweep] [--no-progress]

Prints the policy table and wall time, writes benchmarks/results/fleet_policies.{png,json}, and
(unless --no-sweep) the hit rate against cache size, fleet_policies_sweep.{png,json}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prefixserve.cli import HelpFormatter
from prefixserve.router.costs import CostModel
from prefixserve.router.policies import POLICIES
from prefixserve.simulator.replay import SimulationConfig, capacity_sweep, compare_policies, prepare_routes
from prefixserve.simulator.report import format_table, plot_capacity_sweep, plot_policies, results_to_json
from prefixserve.traces.mooncake import BUILT_IN_TRACES  # noqa: E402
from prefixserve.traces.named import load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent
SWEEP_CAPACITIES = (250, 500, 1000, 2000, 4000, 8000, 16000)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--trace",
        default="conversation",
        help=f"a built-in trace ({', '.join(BUILT_IN_TRACES)}) or a Mooncake .jsonl / .jsonl.gz file",
    )
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas")
    parser.add_argument("--capacity-blocks", type=int, default=1000, help="KV cache per replica in trace blocks")
    parser.add_argument("--costs", help="cost model JSON (default: the built-in H100 estimate)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the hit rate against cache size")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (drawn only on a terminal anyway)")
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for the JSON and PNG results")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost = CostModel.load(args.costs) if args.costs else CostModel()
    config = SimulationConfig(args.replicas, args.capacity_blocks, cost, progress=not args.no_progress)
    began = time.perf_counter()
    trace = load_trace(args.trace)
    routes = prepare_routes(trace)
    loaded = time.perf_counter()
    results = compare_policies(trace, list(POLICIES), config, routes)
    replayed = time.perf_counter()
    print(
        f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s; {config.num_replicas} replicas x "
        f"{config.capacity_blocks} blocks of {trace.block_size} tokens"
    )
    print(format_table(results))
    print(
        f"wall time: {loaded - began:.1f} s to load and key the trace, "
        f"{replayed - loaded:.1f} s to replay {len(POLICIES)} policies"
    )
    (out / "fleet_policies.json").write_text(json.dumps(results_to_json(results), indent=2) + "\n")
    plot_policies(
        results,
        out / "fleet_policies.png",
        f"{trace.name}, {config.num_replicas} replicas, {config.capacity_blocks} blocks each",
    )
    print(f"wrote {out / 'fleet_policies.json'}, {out / 'fleet_policies.png'}")
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
        json.dumps({str(c): results_to_json(rows) for c, rows in sweep.items()}, indent=2) + "\n"
    )
    plot_capacity_sweep(sweep, out / "fleet_policies_sweep.png", f"{trace.name}, {config.num_replicas} replicas")
    print(f"wrote {out / 'fleet_policies_sweep.json'}, {out / 'fleet_policies_sweep.png'}")


if __name__ == "__main__":
    main()
