"""`prefixserve simulate`: replay a trace over simulated replicas (simulator/replay.py) and report,
or `--calibrate` this engine's costs for the replay (engine/operations/calibrate.py, and the tier reads that
`prefixserve plan tiers` times)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ..config import FETCH_POLICIES
from .paths import int_list, output_path
from .plan import LOG_FORMAT  # one way: plan never imports simulate
from .simulate_pd import add_pd_arguments, run_pd
from .tier_reads import add_remote_arguments, measure_tier_reads

if TYPE_CHECKING:  # the router's modules load only when a replay runs
    from ..router.policies import RouteRequest
    from ..simulator.replay import SimulationConfig
    from ..traces.agents import AgentTraceConfig
    from ..traces.mooncake import Trace


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from ..router.policies import POLICIES
    from ..simulator.replay import DEFAULT_CAPACITY_BLOCKS

    parser.add_argument(
        "--trace",
        metavar="NAME|FILE",
        help="a built-in trace: conversation (Mooncake, one hour of chat, 12,031 requests), "
        "synthetic (Mooncake, 3,993 long-context requests), agent (seeded agent sessions); "
        "or a Mooncake trace file, .jsonl or .jsonl.gz. Required unless --calibrate is given",
    )
    parser.add_argument(
        "--agent",
        metavar="KNOB=VALUE,...",
        help="shape the generated agent trace (--trace agent), e.g. num_sessions=80,turns=2-6,"
        "think_times=pareto,num_system_prompts=16,system_prompt_skew=1.2. Knobs: num_sessions, "
        "session_rate (starts/s), session_gaps and think_times (exponential, constant, uniform, "
        "lognormal, pareto), num_system_prompts, system_prompt_skew (Zipf), tool_schema_tokens, "
        "turn_gap_seconds, think_time_mean_seconds; token ranges LOW-HIGH: system_prompt_tokens, "
        "task_tokens, turns, tool_result_tokens, output_tokens (default: the built-in shape)",
    )
    parser.add_argument(
        "--calibrate",
        metavar="COSTS_JSON",
        help="measure the real engine (built-in model) and this machine's host and disk tier reads "
        "(and the remote tier's, given --kv-remote-url), write the cost model to this file and "
        "exit (about a minute); without --kv-remote-url the remote tier keeps its stated cost",
    )
    parser.add_argument("--replicas", type=int, default=8, metavar="N", help="simulated replicas")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        metavar="NAME,...",
        help="routing policies to compare, comma-separated; the gateways' scorers "
        "vllm_router_cache_aware and llm_d_default may be added (router/gateway_policies.py)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=DEFAULT_CAPACITY_BLOCKS,
        metavar="N",
        help="KV cache per replica in 512-token trace blocks (default: %(default)s, "
        "what an 8B model leaves on an 80 GB GPU)",
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        metavar="N",
        help="host-memory tier per replica in trace blocks: blocks evicted from the pool spill "
        "there (default: 0, none)",
    )
    parser.add_argument(
        "--disk-blocks",
        type=int,
        default=0,
        metavar="N",
        help="disk tier per replica in trace blocks: every computed block is written through (default: 0, none)",
    )
    parser.add_argument(
        "--remote-blocks",
        type=int,
        default=0,
        metavar="N",
        help="a remote tier the whole fleet shares, in trace blocks: every replica writes the "
        "blocks it computes, every replica reads. The header gives the trace's working set; "
        "with it the replay runs twice, without and with the remote tier, and reports the "
        "lift (default: 0, none)",
    )
    parser.add_argument(
        "--kv-fetch-policy",
        choices=FETCH_POLICIES,
        default="cost",
        help="what replicas read back from the tiers: cost (what beats recomputing it, as "
        "prefixserve serve does by default) or always (the whole run) (default: %(default)s)",
    )
    parser.add_argument(
        "--costs",
        metavar="COSTS_JSON",
        help="cost model, as a --calibrate run writes it (default: an estimate of Llama-3-8B on one H100)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=1.0,
        metavar="X",
        help="replay the trace's arrivals X times as fast: X times the load on the same fleet (default: %(default)s)",
    )
    add_remote_arguments(parser)  # only with --calibrate
    add_pd_arguments(parser)
    _add_output_and_sweep_arguments(parser)


def _add_output_and_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """simulate's flags after the fleet's: what to write, the sweeps, the seed, the limit and progress."""
    parser.add_argument("--json", metavar="FILE", help="also write policy -> metric -> value here (default: no JSON)")
    parser.add_argument(
        "--plot", metavar="PNG", default="simulate_policies.png", help="PNG comparing the policies; its path is printed"
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument(
        "--sweep",
        choices=["capacity", "load"],
        help="capacity: also replay at several cache sizes and print hit rate against capacity; "
        "load: replay the agent trace (--trace agent) at several loads and print each "
        "policy's hit rate and TTFT (default: no sweep)",
    )
    parser.add_argument(
        "--sweep-capacities",
        metavar="N,N,...",
        help="block counts of the sweep (default: --capacity-blocks x 1/8, 1/4, 1/2, 1, 2, 4)",
    )
    parser.add_argument(
        "--sweep-loads",
        metavar="X,X,...",
        default="0.5,1,2,4",
        help="load factors of the load sweep: the agent trace's sessions and their start rate "
        "times X (default: %(default)s, light to saturating for 8 replicas)",
    )
    parser.add_argument(
        "--sweep-plot", metavar="PNG", help="PNG of the sweep (default: beside --plot, named <plot>_sweep.png)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seeds the agent trace and the randomised policies"
    )
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests (default: all)")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress output (bars are drawn only on a terminal in any case)"
    )


def simulate(args: argparse.Namespace) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        if args.kv_remote_url or args.kv_tier_secret_file:
            raise ValueError(
                "--kv-remote-url and --kv-tier-secret-file time a Redis for --calibrate; a replay "
                "takes the remote tier's cost from --costs"
            )
        if not args.trace:
            raise ValueError(
                "--trace NAME|FILE is required unless --calibrate is given "
                "(built-in traces: conversation, synthetic, agent)"
            )
        return _replay(args)
    except (OSError, ValueError) as error:
        print(f"prefixserve simulate: error: {error}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from ..engine.operations.calibrate import measure_costs  # the one path here that needs torch
    from ..router.costs import CostModel

    path = output_path("--calibrate", args.calibrate)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # model generation and loading say what they do
    measured = measure_costs(progress=not args.no_progress)
    tiers = _measure_tiers(args.kv_remote_url, args.kv_tier_secret_file)
    measured["description"] += (
        "; host, disk and remote reads measured"
        if args.kv_remote_url
        else "; host and disk reads measured, remote stated"
    )
    cost = CostModel(**measured, **tiers)
    cost.save(path)
    print(f"wrote {path}: {cost}")
    return 0


def _measure_tiers(remote_url: Optional[str], secret_file: Optional[str]) -> dict[str, float]:
    """KV bytes per token of the built-in model and its host, (cold) disk and (given a URL) remote read costs, as
    `plan tiers` times them."""
    from ..config import EngineConfig
    from ..engine.device import resolve_device, resolve_dtype
    from ..model import ModelConfig, ensure_default_model
    from ..model.weights.hf_loader import read_config_dict
    from ..plan.tiers import kv_bytes_per_token

    config = EngineConfig()  # what measure_costs ran: the built-in model, the engine's dtype
    model = ModelConfig.from_hf_dict(read_config_dict(ensure_default_model()))
    dtype = str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch.")
    block_shape = (model.num_hidden_layers, 2, config.block_size, model.num_key_value_heads, model.head_dim)
    reads = measure_tier_reads(block_shape, dtype, None, remote_url, secret_file)
    fields = {
        "kv_bytes_per_token": float(
            kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, dtype)
        )
    }
    for tier, cost in reads.items():  # the tiers measure_tier_reads timed (host, disk, remote), by name
        fields[f"{tier}_latency_seconds"] = cost.latency_seconds
        fields[f"{tier}_bytes_per_second"] = cost.bytes_per_second
    return fields


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or not min(values) > 0:
        raise ValueError(f"{flag} must list positive numbers, got {text!r}")
    return values


def _replay(args: argparse.Namespace) -> int:
    from ..router.costs import CostModel
    from ..router.policy_registry import make_policy
    from ..simulator.replay import SimulationConfig, prepare_routes
    from ..traces.agents import AgentTraceConfig, parse_agent_knobs
    from ..traces.named import load_trace

    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    if not policies:
        raise ValueError(f"--policies names no policy ({args.policies!r})")
    for name in policies:
        make_policy(name)  # an unknown name fails before the trace loads
    if args.sweep == "load" and args.trace != "agent":
        raise ValueError(
            f"--sweep load replays the generated agent trace at several loads; give --trace agent "
            f"(got --trace {args.trace})"
        )
    agent = parse_agent_knobs(args.agent) if args.agent else None
    json_path = output_path("--json", args.json) if args.json else None
    plot_path = None if args.no_plot else output_path("--plot", args.plot)
    sweep_plot = args.sweep_plot or (plot_path.with_name(plot_path.stem + "_sweep.png") if plot_path else None)
    sweep_plot = output_path("--sweep-plot", sweep_plot) if args.sweep and sweep_plot else None
    lift_plot = plot_path.with_name(plot_path.stem + "_lift.png") if plot_path and args.remote_blocks else None
    capacities = (
        int_list(args.sweep_capacities, "--sweep-capacities")
        if args.sweep_capacities
        else [max(1, args.capacity_blocks * factor // 8) for factor in (1, 2, 4, 8, 16, 32)]
    )
    loads = _float_list(args.sweep_loads, "--sweep-loads")
    cost = CostModel.load(args.costs) if args.costs else CostModel()
    config = SimulationConfig(
        args.replicas,
        args.capacity_blocks,
        cost,
        host_blocks=args.host_blocks,
        disk_blocks=args.disk_blocks,
        remote_blocks=args.remote_blocks,
        fetch_policy=args.kv_fetch_policy,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.pd and args.sweep:
        raise ValueError("--pd and --sweep are separate replays; run them one at a time")
    trace = load_trace(args.trace, args.limit, args.seed, agent).at_rate(args.rate)
    routes = prepare_routes(trace)
    if args.pd:
        for path in run_pd(args, trace, routes, config, plot_path):
            print(f"wrote {path}")
        return 0
    written = _compare(trace, routes, policies, config, json_path, plot_path, lift_plot)
    if args.sweep == "capacity":
        written += _capacity_sweep(trace, policies, capacities, config, sweep_plot)
    elif args.sweep == "load":
        written += _load_sweep(policies, loads, config, agent or AgentTraceConfig(), sweep_plot)
    for path in written:
        print(f"wrote {path}")
    return 0


def _compare(
    trace: Trace,
    routes: Sequence[RouteRequest],
    policies: list[str],
    config: SimulationConfig,
    json_path: Optional[Path],
    plot_path: Optional[Path],
    lift_plot: Optional[Path],
) -> list[Path]:
    """The policy table (twice with a remote tier: local only, then with it); returns the files written."""
    from ..simulator.replay import compare_policies, working_set_blocks
    from ..simulator.report import format_table, plot_policies, plot_tier_lift, results_to_json

    began = time.perf_counter()
    results = compare_policies(trace, policies, config, routes)
    local = None
    if config.remote_blocks:
        local = compare_policies(trace, policies, replace(config, remote_blocks=0), routes)
    tiers = ", ".join(f"{tier} {getattr(config, f'{tier}_blocks'):,}" for tier in config.tier_names) or "none"
    print(
        f"{trace.name}: {len(trace)} requests over {trace.duration:.0f} s, {config.num_replicas} replicas x "
        f"{config.capacity_blocks} blocks of {trace.block_size} tokens; tiers below the pool: {tiers} "
        f"(working set {working_set_blocks(routes):,} blocks) ({time.perf_counter() - began:.1f} s)"
    )
    if local is not None:
        print("local only (no remote tier):")
        print(format_table(local))
        print(f"with a remote tier of {config.remote_blocks:,} blocks shared by the fleet:")
    print(format_table(results))
    title = f"{trace.name}, {config.num_replicas} replicas"
    written: list[Path] = []
    if json_path:
        body = results_to_json(results)
        if local is not None:
            body = {"local_only": results_to_json(local), "with_remote": body}
        json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    if plot_path:
        plot_policies(results, plot_path, title)
        written.append(plot_path)
    if lift_plot and local is not None:
        plot_tier_lift(
            local, results, lift_plot, f"{title}: a {config.remote_blocks:,}-block remote tier", "with the remote tier"
        )
        written.append(lift_plot)
    return written


def _capacity_sweep(
    trace: Trace, policies: list[str], capacities: list[int], config: SimulationConfig, sweep_plot: Optional[Path]
) -> list[Path]:
    from ..simulator.replay import capacity_sweep
    from ..simulator.report import plot_capacity_sweep

    sweep = capacity_sweep(trace, policies, capacities, config)
    for capacity, rows in sweep.items():
        print(f"capacity {capacity}: " + ", ".join(f"{r.policy} {r.hit_rate:.1%}" for r in rows))
    if not sweep_plot:
        return []
    plot_capacity_sweep(sweep, sweep_plot, f"{trace.name}, {config.num_replicas} replicas")
    return [sweep_plot]


def _load_sweep(
    policies: list[str],
    loads: list[float],
    config: SimulationConfig,
    agent: "AgentTraceConfig",
    sweep_plot: Optional[Path],
) -> list[Path]:
    from ..simulator.replay import load_sweep
    from ..simulator.report import format_load_sweep, plot_load_sweep

    began = time.perf_counter()
    sweep = load_sweep(policies, loads, config, agent)
    shape = f" ({agent.describe()})" if agent.describe() else ""
    print(
        f"agent sessions{shape} across load, seed {config.seed}, {config.num_replicas} replicas "
        f"({time.perf_counter() - began:.1f} s):"
    )
    print(format_load_sweep(sweep))
    if not sweep_plot:
        return []
    plot_load_sweep(sweep, sweep_plot, f"agent sessions{shape}, {config.num_replicas} replicas")
    return [sweep_plot]
