"""Whole against disaggregated fleets of 8, 16 and 32 replicas on the Mooncake conversation trace, at high load.

    python benchmarks/simulate_pd.py [--sizes 8,16,32] [--rate-per-8 1.5] [--fabric-gbps 25] [--splits 1/4,5/16,3/8]
                                     [--variants 0/-,16384/-,16384/2,12288/4,17408/12] [--costs costs.json]
                                     [--no-progress]

Each fleet of N replicas replays the trace's arrivals N/8 x --rate-per-8 as fast (the same load per
replica), whole (N `both` replicas) and split with each --splits share of prefill replicas (default N/4,
5N/16 and 3N/8, rounded down, at least one) in each variant LOCAL/QUEUE: prompts
the decode replica lacks at most LOCAL tokens of are prefilled there (0: none), and all of them while every
prefill replica has more than QUEUE seconds queued (-: no limit): conditional disaggregation. Every fleet
shares a tier that holds the whole
working set, read and written at --fabric-gbps (the KV hand-off's fabric: 25 GB/s is a 200 Gb/s RDMA NIC;
stated, not measured). Prints one row a fleet and writes benchmarks/results/simulate_pd.{json,png}.
The figures are simulated seconds: the same on any CPU.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from prefixserve.cli import HelpFormatter
from prefixserve.router.costs import CostModel
from prefixserve.simulator.pd_replay import fleet_roles, simulate_steps
from prefixserve.simulator.replay import SimulationConfig, prepare_routes, working_set_blocks
from prefixserve.simulator.report import _align
from prefixserve.traces.named import load_trace

ROOT = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, formatter_class=HelpFormatter
    )
    parser.add_argument("--sizes", default="8,16,32", help="fleet sizes")
    parser.add_argument(
        "--rate-per-8", type=float, default=1.5, help="arrival rate factor for 8 replicas; N replicas get N/8 times it"
    )
    parser.add_argument("--fabric-gbps", type=float, default=25.0, help="shared tier read/write GB/s")
    parser.add_argument(
        "--variants",
        default="0/-,16384/-,16384/2,12288/4,17408/12",
        help="conditional disaggregation: LOCAL_TOKENS/QUEUE_SECONDS (- for no queue limit), ...",
    )
    parser.add_argument(
        "--splits",
        default="1/4,5/16,3/8",
        help="shares of each fleet that are prefill replicas, as fractions A/B, comma-separated",
    )
    parser.add_argument("--costs", help="cost model JSON (default: the built-in H100 estimate)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (drawn only on a terminal anyway)")
    parser.add_argument("--out", default=str(ROOT / "results"), help="folder for the JSON and PNG results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cost = replace(
        CostModel.load(args.costs) if args.costs else CostModel(), remote_bytes_per_second=args.fabric_gbps * 1e9
    )
    base = load_trace("conversation")
    routes = prepare_routes(base)
    working_set = working_set_blocks(routes)
    try:
        splits = [Fraction(text) for text in args.splits.split(",")]
    except ValueError:
        splits = []
    if not splits or not all(0 < share < 1 for share in splits):
        parser.error(f"--splits takes fractions between 0 and 1, e.g. 1/4,3/8; got {args.splits!r}")
    variants = [
        (int(local), math.inf if queue == "-" else float(queue))
        for local, queue in (variant.split("/") for variant in args.variants.split(","))
    ]
    rows = [
        (
            "replicas",
            "rate",
            "fleet",
            "local / queue",
            "TTFT p50",
            "TTFT p99",
            "TPOT p99",
            "TPOT p99 better",
            "TTFT p50 ratio",
            "KV moved/req",
        )
    ]
    body: dict = {}
    for size in (int(value) for value in args.sizes.split(",")):
        rate = args.rate_per_8 * size / 8
        trace = base.at_rate(rate)
        config = SimulationConfig(size, cost=cost, remote_blocks=working_set, progress=not args.no_progress)
        whole = simulate_steps(trace, "kv_aware", config, fleet_roles(size, 0), routes)
        runs = [(whole, "-")]
        for prefill in sorted({max(1, min(size - 1, math.floor(size * share))) for share in splits}):
            for local, queue in variants:
                runs.append(
                    (
                        simulate_steps(
                            trace,
                            "kv_aware",
                            config,
                            fleet_roles(prefill, size - prefill),
                            routes,
                            local_prefill_tokens=local,
                            max_prefill_queue=queue,
                        ),
                        f"{local:,} / {queue:g} s" if queue < math.inf else f"{local:,} / -",
                    )
                )
        for result, variant in runs:
            better = whole.percentile("tpot", 99) / result.percentile("tpot", 99)
            ratio = result.percentile("ttft", 50) / whole.percentile("ttft", 50)
            rows.append(
                (
                    str(size),
                    f"x{rate:g}",
                    result.name,
                    variant,
                    f"{result.percentile('ttft', 50):.3f} s",
                    f"{result.percentile('ttft', 99):.2f} s",
                    f"{result.percentile('tpot', 99):.3f} s",
                    f"{better:.2f}x",
                    f"{ratio:.2f}x",
                    f"{result.moved_bytes_per_request / 1e9:.2f} GB",
                )
            )
            body[f"{size}/{result.name}/{variant}"] = {
                **result.metrics(),
                "rate": rate,
                "tpot_p99_better": better,
                "ttft_p50_ratio": ratio,
            }
        print(_align(rows, num_left=4), flush=True)
        rows = rows[:1]
    (out / "simulate_pd.json").write_text(json.dumps(body, indent=2) + "\n")
    _plot(body, out / "simulate_pd.png")
    print(f"wrote {out / 'simulate_pd.json'}, {out / 'simulate_pd.png'}")


def _plot(body: dict, path: Path) -> None:
    """TPOT p99 gain against TTFT p50 ratio of each split, colored by fleet size (ratios over 2 are left out:
    the table has them)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 6), layout="constrained")
    axis = figure.subplots()
    colors = {}
    for name, values in body.items():
        size, fleet, variant = name.split("/", 2)
        if fleet.startswith("both") or values["ttft_p50_ratio"] > 2:
            continue
        color = colors.setdefault(size, f"C{len(colors)}")
        axis.scatter(
            values["ttft_p50_ratio"],
            values["tpot_p99_better"],
            color=color,
            label=f"{size} replicas"
            if sum(1 for c in axis.collections if c.get_label() == f"{size} replicas") == 0
            else None,
        )
        axis.annotate(
            f"{fleet.removeprefix('pd ')} {variant}",
            (values["ttft_p50_ratio"], values["tpot_p99_better"]),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    axis.axvline(1.1, color="black", linestyle="--")
    axis.axhline(1.5, color="black", linestyle="--")
    axis.set_xlabel("TTFT p50, split / whole (goal: at most 1.1)")
    axis.set_ylabel("TPOT p99, whole / split (goal: at least 1.5)")
    axis.legend()
    figure.suptitle("disaggregated against whole fleets (split local/queue), Mooncake conversation trace")
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
