"""`prefixserve serve | route | simulate | plan`: the command line.

One parser for every command: each flag shows its help and its default, and no flag may be
abbreviated (argparse would otherwise take `--replica 8` for `--replicas 8` without a word).
`serve` and `route` keep their flags beside the servers they build (server/launch.py,
router/launch.py); `simulate`'s flags and run live here, since it only glues the router's
traces, replay and report together, and so do `plan`'s: it measures what the planners in
plan/ (pure computation) take as numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

from .router.launch import add_route_arguments, route
from .server.launch import add_serve_arguments, serve

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default or there is
    nothing to show: a switch that is off, or None, whose meaning the help text says in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is False or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixserve", allow_abbrev=False,
                                     description="LLM serving with a token-exact prefix KV cache")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        subparser = commands.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter,
                                        allow_abbrev=False)
        subparser.set_defaults(usage_error=subparser.error)  # a command's mistakes shown with its own usage
        return subparser

    add_serve_arguments(command("serve", "OpenAI-compatible server (a small default model is built in)"))
    add_route_arguments(command("route", "cache-aware router in front of 'prefixserve serve' replicas"))
    add_simulate_arguments(command("simulate", "replay a request trace over simulated replicas and compare "
                                               "routing policies"))
    add_plan_arguments(command("plan", "planners on measured or given inputs (tiers: when fetching a prefix's KV "
                                       "from host RAM or disk beats recomputing it)"))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args, unknown = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        args.usage_error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        return serve(args)
    if args.command == "route":
        return route(args)
    if args.command == "plan":
        return plan(args)
    return simulate(args)


# ------------------------------------------------------------------- simulate
def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from .router.policies import POLICIES
    from .router.simulate import DEFAULT_CAPACITY_BLOCKS

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
    from .engine.calibrate import measure_costs  # the one path here that needs torch
    from .router.costs import CostModel

    path = _output_path("--calibrate", args.calibrate)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # model generation and loading say what they do
    cost = CostModel(**measure_costs(progress=not args.no_progress))
    cost.save(path)
    print(f"wrote {path}: {cost}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .router.costs import CostModel
    from .router.policies import make_policy
    from .router.report import format_table, plot_capacity_sweep, plot_policies, results_to_json
    from .router.simulate import SimulationConfig, capacity_sweep, compare_policies
    from .router.traces import load_trace

    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    if not policies:
        raise ValueError(f"--policies names no policy ({args.policies!r})")
    for name in policies:
        make_policy(name)  # an unknown name fails before the trace loads
    json_path = _output_path("--json", args.json) if args.json else None
    plot_path = None if args.no_plot else _output_path("--plot", args.plot)
    sweep_plot = args.sweep_plot or (plot_path.with_name(plot_path.stem + "_sweep.png") if plot_path else None)
    sweep_plot = _output_path("--sweep-plot", sweep_plot) if args.sweep and sweep_plot else None
    capacities = (_int_list(args.sweep_capacities, "--sweep-capacities") if args.sweep_capacities
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


# ----------------------------------------------------------------------- plan
PLAN_TIERS_SUMMARY = ("print per KV tier (host, disk) the prefix length above which fetching beats recomputing, "
                      "for this machine and model (measured) and for a stated GPU profile, beside the literature's "
                      "figure")
READ_SIZES_BLOCKS = (1, 8, 32, 125)  # runs timed per tier: 125 blocks of 16 are the 2,000-token reference prefix
READ_REPEATS = 5


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from .config import DTYPES, EngineConfig

    actions = parser.add_subparsers(dest="plan_action", required=True, metavar="ACTION")
    tiers = actions.add_parser("tiers", help=PLAN_TIERS_SUMMARY, description=PLAN_TIERS_SUMMARY,
                               formatter_class=HelpFormatter, allow_abbrev=False)
    tiers.set_defaults(usage_error=tiers.error)
    tiers.add_argument("--model", metavar="DIR|FILE.gguf|NAME",
                       help="checkpoint whose KV blocks and prefill are planned for: a Hugging Face directory, a "
                            ".gguf file or a model name (default: the built-in prefixserve-tiny)")
    tiers.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="KV dtype; auto is the engine's choice (float32 on CPU, bfloat16 on CUDA)")
    tiers.add_argument("--block-size", type=int, default=EngineConfig.block_size, metavar="N",
                       help="tokens per KV block, as the engine's block_size")
    tiers.add_argument("--prefill-seconds-per-token", type=float, metavar="SECONDS",
                       help="this engine's prefill cost per token, e.g. from 'simulate --calibrate'; skips measuring "
                            "it (default: measured with the engine, about a minute)")
    tiers.add_argument("--disk-dir", metavar="DIR",
                       help="a folder on the disk to time; a temporary folder is made in it and removed "
                            "(default: the system's temporary folder)")
    tiers.add_argument("--json", metavar="FILE", help="also write the report here (default: no JSON)")
    tiers.add_argument("--no-progress", action="store_true",
                       help="no progress output while measuring prefill (a bar is drawn only on a terminal)")


def plan(args: argparse.Namespace) -> int:
    try:
        return _plan_tiers(args)
    except (OSError, ValueError) as error:
        print(f"prefixserve plan {args.plan_action}: error: {error}", file=sys.stderr)
        return 2


def _plan_tiers(args: argparse.Namespace) -> int:
    from .config import EngineConfig
    from .engine.device import resolve_device, resolve_dtype
    from .model import DEFAULT_MODEL_NAME, ModelConfig
    from .model.loader import read_config_dict
    from .plan.tiers import (REFERENCE_PREFIX_TOKENS, Profile, format_report, gpu_profile, kv_bytes_per_token,
                             report_json)
    from .tiers.disk import DISK_READ_COST
    from .tiers.host import HOST_READ_COST

    config = EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size)  # validates both
    if args.prefill_seconds_per_token is not None and not args.prefill_seconds_per_token > 0:
        raise ValueError(f"--prefill-seconds-per-token must be positive seconds, got {args.prefill_seconds_per_token}")
    json_path = _output_path("--json", args.json) if args.json else None
    if args.disk_dir and not Path(args.disk_dir).is_dir():
        raise FileNotFoundError(f"--disk-dir {args.disk_dir}: not a folder; create it or pick another")
    model = ModelConfig.from_hf_dict(read_config_dict(_model_dir(args.model)))
    dtype = str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch.")
    block_shape = (model.num_hidden_layers, 2, config.block_size, model.num_key_value_heads, model.head_dim)
    block_bytes = kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
                                     dtype) * config.block_size
    read_costs = _measure_tier_reads(block_shape, dtype, args.disk_dir)
    prefill, source = args.prefill_seconds_per_token, "given"
    if prefill is None:
        from .engine.calibrate import measure_costs  # loads the model and runs it: the slow part

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        costs = measure_costs(progress=not args.no_progress, model=args.model, dtype=dtype)
        # The mean over a reference-length prefill, attention included: what the engine's planner learns from steps.
        prefill = (float(costs["prefill_seconds_per_token"])
                   + float(costs["attention_seconds_per_token_pair"]) * REFERENCE_PREFIX_TOKENS / 2)
        source = (f"measured: the mean over a {REFERENCE_PREFIX_TOKENS:,}-token prefill, attention included "
                  f"(engine/calibrate)")
    name = f"this machine: {args.model or DEFAULT_MODEL_NAME}, {dtype}"
    machine = Profile(f"{name} (measured)", config.block_size, block_bytes, prefill, read_costs, (
        f"KV: {model.num_hidden_layers} layers x 2 x {model.num_key_value_heads} KV heads x {model.head_dim} "
        f"= {block_bytes // config.block_size:,} bytes per token; blocks of {config.block_size} tokens",
        f"prefill: {prefill * 1e3:.3g} ms per token, {source}",
        f"reads: runs of {', '.join(map(str, READ_SIZES_BLOCKS))} blocks, median of {READ_REPEATS}, through the "
        f"tier's get and the record check; disk files fsynced and dropped from the page cache first (cold); the "
        f"copy into the pool is not included",
    ))
    priors = Profile(f"{name}, the tiers' start-up priors (before any read is observed)", config.block_size,
                     block_bytes, prefill, {"host": HOST_READ_COST, "disk": DISK_READ_COST})
    gpu = gpu_profile()
    print("\n".join(format_report([machine, priors, gpu], gpu)))
    if json_path:
        json_path.write_text(json.dumps(report_json([machine, priors, gpu], gpu), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def _model_dir(model: Optional[str]) -> Path:
    if model is None:
        from .model import ensure_default_model

        return ensure_default_model()
    from .model.named_models import resolve_model

    return resolve_model(model)


def _measure_tier_reads(block_shape: tuple[int, ...], dtype: str, disk_dir: Optional[str]) -> dict:
    """Latency and bandwidth of host and (cold) disk reads of real records: a chain written, then runs read back."""
    import hashlib
    import os
    import statistics
    import tempfile

    from .plan.tiers import fit_read_cost
    from .tiers import BlockRecord, DiskTier, HostTier, RecordExpectation, decode_record
    from .tiers.disk_files import record_path
    from .tiers.record import DTYPE_SIZES

    block_size, block_bytes = block_shape[2], math.prod(block_shape) * DTYPE_SIZES[dtype]
    scope = hashlib.sha256(b"prefixserve plan tiers").digest()
    records, parent = [], None
    for index in range(max(READ_SIZES_BLOCKS)):
        key = hashlib.sha256(scope + index.to_bytes(4, "little")).digest()
        records.append(BlockRecord(key, parent, scope, tuple(range(index * block_size, (index + 1) * block_size)),
                                   dtype, block_shape, os.urandom(block_bytes)))
        parent = key
    capacity = 2 * len(records) * (block_bytes + 4096)
    with tempfile.TemporaryDirectory(prefix="prefixserve-plan-", dir=disk_dir) as directory:
        def drop_page_cache(chosen: list[BlockRecord]) -> None:
            for record in chosen:
                fd = os.open(record_path(Path(directory), record.key), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced pages are clean: this drops them
                finally:
                    os.close(fd)

        def time_read(tier, chosen: list[BlockRecord]) -> float:
            if tier.name == "disk" and hasattr(os, "posix_fadvise"):
                drop_page_cache(chosen)
            start = time.perf_counter()
            for record, data in zip(chosen, tier.get([record.key for record in chosen])):
                decode_record(data, RecordExpectation(record.key, scope, record.token_ids, dtype, block_shape))
            return time.perf_counter() - start

        costs = {}
        for tier in (HostTier(capacity), DiskTier(directory, capacity, expect_scope=scope)):
            with tier:
                tier.put(records)
                samples = [(size * block_bytes, statistics.median(time_read(tier, records[:size])
                                                                  for _ in range(READ_REPEATS)))
                           for size in READ_SIZES_BLOCKS]
            costs[tier.name] = fit_read_cost(samples)
    return costs


def _output_path(flag: str, value: str | Path) -> Path:
    """The absolute path a flag names for writing, checked before any long run: a file in an existing folder."""
    path = Path(value).expanduser().resolve()
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {value}: is a directory; name a file to write")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{flag} {value}: folder {path.parent} does not exist; create it or pick another path")
    return path


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
