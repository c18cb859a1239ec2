"""`prefixserve simulate`: replay a trace over simulated replicas (router/simulate.py) and report,
or `--calibrate` this engine's costs for the replay (engine/calibrate.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .paths import int_list, output_path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..router.policies import POLICIES
    from ..router.simulate import DEFAULT_CAPACITY_BLOCKS

    parser.add_argument("--trace", metavar="NAME|FILE",
                        help="a built-in trace: conversation (Mooncake, one hour of chat, 12,031 requests), "
                             "synthetic (Mooncake, 3,993 long-context requests), agent (seeded agent sessions); "
                             "or a Mooncake trace file, .jsonl or .jsonl.gz. Required unless --calibrate is given")
    parser.add_argument("--calibrate", metavar="COSTS_JSON",
                        help="measure the real engine (built-in model) on this machine, write its cost model to "
                             "this file and exit (about a minute)")
    parser.add_argument("--replicas", type=int, default=8, metavar="N", help="simulated replicas")
    parser.add_argument("--policies", default=",".join(POLICIES), metavar="NAME,...",
                        help="routing policies to compare, comma-separated")
    parser.add_argument("--capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS,
                        metavar="N", help="KV cache per replica in 512-token trace blocks (default: %(default)s, "
                                          "what an 8B model leaves on an 80 GB GPU)")
    parser.add_argument("--costs", metavar="COSTS_JSON",
                        help="cost model, as a --calibrate run writes it "
                             "(default: an estimate of Llama-3-8B on one H100)")
    parser.add_argument("--json", metavar="FILE", help="also write policy -> metric -> value here (default: no JSON)")
    parser.add_argument("--plot", metavar="PNG", default="simulate_policies.png",
                        help="PNG comparing the policies; its path is printed")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--sweep", choices=["capacity"],
                        help="also replay at several cache sizes and print hit rate against capacity "
                             "(default: no sweep)")
    parser.add_argument("--sweep-capacities", metavar="N,N,...",
                        help="block counts of the sweep (default: --capacity-blocks x 1/8, 1/4, 1/2, 1, 2, 4)")
    parser.add_argument("--sweep-plot", metavar="PNG",
                        help="PNG of the sweep (default: beside --plot, named <plot>_sweep.png)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seeds the agent trace and the randomised policies")
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests (default: all)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress output (bars are drawn only on a terminal in any case)")


def simulate(args: argparse.Namespace) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        if not args.trace:
            raise ValueError("--trace NAME|FILE is required unless --calibrate is given "
                             "(built-in traces: conversation, synthetic, agent)")
        return _replay(args)
    except (OSError, ValueError) as error:
        print(f"prefixserve simulate: error: {error}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from ..engine.calibrate import measure_costs  # the one path here that needs torch
    from ..router.costs import CostModel

    path = output_path("--calibrate", args.calibrate)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # model generation and loading say what they do
    cost = CostModel(**measure_costs(progress=not args.no_progress))
    cost.save(path)
    print(f"wrote {path}: {cost}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ..router.costs import CostModel
    from ..router.policies import make_policy
    from ..router.report import format_table, plot_capacity_sweep, plot_policies, results_to_json
    from ..router.simulate import SimulationConfig, capacity_sweep, compare_policies
    from ..router.traces import load_trace

    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    if not policies:
        raise ValueError(f"--policies names no policy ({args.policies!r})")
    for name in policies:
        make_policy(name)  # an unknown name fails before the trace loads
    json_path = output_path("--json", args.json) if args.json else None
    plot_path = None if args.no_plot else output_path("--plot", args.plot)
    sweep_plot = args.sweep_plot or (plot_path.with_name(plot_path.stem + "_sweep.png") if plot_path else None)
    sweep_plot = output_path("--sweep-plot", sweep_plot) if args.sweep and sweep_plot else None
    capacities = (int_list(args.sweep_capacities, "--sweep-capacities") if args.sweep_capacities
                  else [max(1, args.capacity_blocks * factor // 8) for factor in (1, 2, 4, 8, 16, 32)])
    cost = CostModel.load(args.costs) if args.costs else CostModel()
    config = SimulationConfig(args.replicas, args.capacity_blocks, cost, args.seed, progress=not args.no_progress)
    trace = load_trace(args.trace, args.limit, args.seed)

    began = time.perf_counter()
    results = compare_policies(trace, policies, config)
    print(f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s, {config.num_replicas} replicas x "
          f"{config.capacity_blocks} blocks of {trace.block_size} tokens ({time.perf_counter() - began:.1f} s)")
    print(format_table(results))
    title = f"{trace.name}, {config.num_replicas} replicas"
    if json_path:
        json_path.write_text(json.dumps(results_to_json(results), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    if plot_path:
        plot_policies(results, plot_path, title)
        print(f"wrote {plot_path}")
    if args.sweep == "capacity":
        sweep = capacity_sweep(trace, policies, capacities, config)
        for capacity, rows in sweep.items():
            print(f"capacity {capacity}: " + ", ".join(f"{r.policy} {r.hit_rate:.1%}" for r in rows))
        if sweep_plot:
            plot_capacity_sweep(sweep, sweep_plot, title)
            print(f"wrote {sweep_plot}")
    return 0
