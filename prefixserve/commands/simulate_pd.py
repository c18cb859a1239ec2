"""`prefixserve simulate --pd P:D`: a whole fleet against prefill/decode splits of the same replicas."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from .paths import output_path

if TYPE_CHECKING:
    from ..router.policies import RouteRequest
    from ..simulator.replay import SimulationConfig
    from ..traces.mooncake import Trace


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pd",
        metavar="P:D,...",
        help="replay step by step (chunked prefill slows decode on a replica that does both) and "
        "compare --replicas whole replicas with these prefill:decode splits of them, which "
        "hand prompts over through the shared tier (--remote-blocks; default: the trace's "
        "working set), e.g. --replicas 8 --pd 5:3,6:2 (default: no P/D replay)",
    )
    parser.add_argument(
        "--pd-policy",
        default="kv_aware",
        metavar="NAME",
        help="the policy that picks the prefill and then the decode replica (default: %(default)s)",
    )
    parser.add_argument(
        "--pd-local-prefill",
        type=int,
        default=0,
        metavar="TOKENS",
        help="with --pd, prefill a prompt on its decode replica when that replica lacks at most "
        "this many of its tokens (conditional disaggregation: short prefills are not worth "
        "a hand-off) (default: 0, hand every prompt over)",
    )
    parser.add_argument(
        "--pd-max-prefill-queue",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --pd, prefill every prompt on its decode replica while the least queued prefill "
        "replica has more than this many seconds of prefill queued (default: no limit)",
    )
    parser.add_argument(
        "--pd-trails",
        metavar="JSONL",
        help="with --pd, write one JSON line per request and fleet: which replicas had the prefix, "
        "bytes moved, prefill seconds reuse saved, waits, TTFT, TPOT (default: none)",
    )


def parse_splits(text: str, num_replicas: int) -> list[tuple[int, int]]:
    from ..simulator.pd_replay import parse_pd

    splits = [parse_pd(part.strip()) for part in text.split(",") if part.strip()]
    if not splits:
        raise ValueError(f"--pd names no split ({text!r}); give PREFILL:DECODE counts, e.g. 5:3")
    for prefill, decode in splits:
        if prefill + decode != num_replicas:
            raise ValueError(
                f"--pd {prefill}:{decode} has {prefill + decode} replicas but --replicas is "
                f"{num_replicas}: the comparison is at equal hardware, give splits of {num_replicas}"
            )
    return splits


def run_pd(
    args: argparse.Namespace,
    trace: Trace,
    routes: Sequence[RouteRequest],
    config: SimulationConfig,
    plot_path: Optional[Path],
) -> list[Path]:
    """Replay the whole fleet and each split; print the table and the comparisons; return the files written."""
    from ..router.policy_registry import make_policy
    from ..simulator.pd_replay import fleet_roles, simulate_steps, trails_to_rows
    from ..simulator.pd_report import compare_line, format_pd_table, plot_pd
    from ..simulator.replay import working_set_blocks

    make_policy(args.pd_policy)  # an unknown name fails before any replay
    splits = parse_splits(args.pd, config.num_replicas)
    json_path = output_path("--json", args.json) if args.json else None
    trails_path = output_path("--pd-trails", args.pd_trails) if args.pd_trails else None
    working_set = working_set_blocks(routes)
    if not config.remote_blocks:
        config = replace(config, remote_blocks=working_set)
    began = time.perf_counter()
    results = [simulate_steps(trace, args.pd_policy, config, fleet_roles(config.num_replicas, 0), routes)]
    results += [
        simulate_steps(
            trace,
            args.pd_policy,
            config,
            fleet_roles(p, d),
            routes,
            local_prefill_tokens=args.pd_local_prefill,
            max_prefill_queue=math.inf if args.pd_max_prefill_queue is None else args.pd_max_prefill_queue,
        )
        for p, d in splits
    ]
    cost = config.cost
    print(
        f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s, {config.num_replicas} replicas x "
        f"{config.capacity_blocks} blocks of {trace.block_size} tokens, shared tier {config.remote_blocks:,} blocks "
        f"(working set {working_set:,}) at {cost.remote_bytes_per_second / 1e9:g} GB/s, {args.pd_policy}, "
        f"prefill chunks of {cost.prefill_chunk_tokens:g} tokens"
        + (f", local prefill up to {args.pd_local_prefill:,} tokens" if args.pd_local_prefill else "")
        + (f" or past {args.pd_max_prefill_queue:g} s of prefill queue" if args.pd_max_prefill_queue else "")
        + f" ({time.perf_counter() - began:.1f} s)"
    )
    print(format_pd_table(results))
    for split in results[1:]:
        print(compare_line(results[0], split))
    written: list[Path] = []
    if json_path:
        json_path.write_text(json.dumps({r.name: r.metrics() for r in results}, indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    if trails_path:
        with trails_path.open("w", encoding="utf-8") as out:
            for result in results:
                for row in trails_to_rows(result):
                    out.write(json.dumps({"fleet": result.name, **row}) + "\n")
        written.append(trails_path)
    if plot_path:
        plot_pd(results, plot_path, f"{trace.name}: whole and disaggregated fleets of {config.num_replicas}")
        written.append(plot_path)
    return written
