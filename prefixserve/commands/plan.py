"""`prefixserve plan tiers`: measure what the planners in plan/ (pure computation) take as numbers."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from .paths import output_path
from .plan_price import add_plan_price_arguments, plan_price_command
from .plan_ttl import add_plan_ttl_arguments, plan_ttl_command
from .tier_reads import READ_REPEATS, READ_SIZES_BLOCKS, add_remote_arguments, measure_tier_reads, remote_assumption

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PLAN_TIERS_SUMMARY = (
    "print per KV tier (host, disk, and a Redis given by URL) the prefix length above which fetching "
    "beats recomputing, "
    "for this machine and model (measured) and for a stated GPU profile, beside the literature's "
    "figure"
)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from ..server.engine_flags import add_engine_argument

    actions = parser.add_subparsers(dest="plan_action", required=True, metavar="ACTION")
    tiers = actions.add_parser(
        "tiers",
        help=PLAN_TIERS_SUMMARY,
        description=PLAN_TIERS_SUMMARY,
        formatter_class=parser.formatter_class,
        allow_abbrev=False,
    )
    tiers.set_defaults(usage_error=tiers.error)
    tiers.add_argument(
        "--model",
        metavar="DIR|FILE.gguf|NAME",
        help="checkpoint whose KV blocks and prefill are planned for: a Hugging Face directory, a "
        ".gguf file or a model name (default: the built-in prefixserve-tiny)",
    )
    add_engine_argument(tiers, "dtype")  # as 'prefixserve serve' takes them
    add_engine_argument(tiers, "block_size")
    tiers.add_argument(
        "--prefill-seconds-per-token",
        type=float,
        metavar="SECONDS",
        help="this engine's prefill cost per token, e.g. from 'simulate --calibrate'; skips measuring "
        "it (default: measured with the engine, about a minute)",
    )
    tiers.add_argument(
        "--disk-dir",
        metavar="DIR",
        help="a folder on the disk to time; a temporary folder is made in it and removed "
        "(default: the system's temporary folder)",
    )
    add_remote_arguments(tiers)
    tiers.add_argument("--json", metavar="FILE", help="also write the report here (default: no JSON)")
    tiers.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output while measuring prefill (a bar is drawn only on a terminal)",
    )
    add_plan_ttl_arguments(actions, parser.formatter_class)
    add_plan_price_arguments(actions, parser.formatter_class)


def plan(args: argparse.Namespace) -> int:
    try:
        if args.plan_action == "price":
            return plan_price_command(args)
        return plan_ttl_command(args) if args.plan_action == "ttl" else _plan_tiers(args)
    except (OSError, ValueError) as error:
        print(f"prefixserve plan {args.plan_action}: error: {error}", file=sys.stderr)
        return 2


def _plan_tiers(args: argparse.Namespace) -> int:
    from ..config import EngineConfig
    from ..engine.device import resolve_device, resolve_dtype
    from ..model import DEFAULT_MODEL_NAME, ModelConfig
    from ..model.weights.hf_loader import read_config_dict
    from ..plan.tiers import (
        REFERENCE_PREFIX_TOKENS,
        Profile,
        format_report,
        gpu_profile,
        kv_bytes_per_token,
        report_json,
    )
    from ..tiers.disk import DISK_READ_COST
    from ..tiers.host import HOST_READ_COST

    config = EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size)  # validates both
    if args.prefill_seconds_per_token is not None and not args.prefill_seconds_per_token > 0:
        raise ValueError(f"--prefill-seconds-per-token must be positive seconds, got {args.prefill_seconds_per_token}")
    json_path = output_path("--json", args.json) if args.json else None
    if args.disk_dir and not Path(args.disk_dir).is_dir():
        raise FileNotFoundError(f"--disk-dir {args.disk_dir}: not a folder; create it or pick another")
    model = ModelConfig.from_hf_dict(read_config_dict(_model_dir(args.model)))
    dtype = str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch.")
    block_shape = (model.num_hidden_layers, 2, config.block_size, model.num_key_value_heads, model.head_dim)
    block_bytes = (
        kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, dtype)
        * config.block_size
    )
    read_costs = measure_tier_reads(block_shape, dtype, args.disk_dir, args.kv_remote_url, args.kv_tier_secret_file)
    prefill, source = args.prefill_seconds_per_token, "given"
    if prefill is None:
        from ..engine.operations.calibrate import measure_costs  # loads the model and runs it: the slow part

        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        costs = measure_costs(progress=not args.no_progress, model=args.model, dtype=dtype)
        # The mean over a reference-length prefill, attention included: what the engine's planner learns from steps.
        prefill = (
            float(costs["prefill_seconds_per_token"])
            + float(costs["attention_seconds_per_token_pair"]) * REFERENCE_PREFIX_TOKENS / 2
        )
        source = (
            f"measured: the mean over a {REFERENCE_PREFIX_TOKENS:,}-token prefill, attention included "
            f"(engine/calibrate)"
        )
    name = f"this machine: {args.model or DEFAULT_MODEL_NAME}, {dtype}"
    machine = Profile(
        f"{name} (measured)",
        config.block_size,
        block_bytes,
        prefill,
        read_costs,
        (
            f"KV: {model.num_hidden_layers} layers x 2 x {model.num_key_value_heads} KV heads x {model.head_dim} "
            f"= {block_bytes // config.block_size:,} bytes per token; blocks of {config.block_size} tokens",
            f"prefill: {prefill * 1e3:.3g} ms per token, {source}",
            f"reads: runs of {', '.join(map(str, READ_SIZES_BLOCKS))} blocks, median of {READ_REPEATS}, through the "
            f"tier's get and the record check; disk files fsynced and dropped from the page cache first (cold); the "
            f"copy into the pool is not included",
            remote_assumption(args.kv_remote_url, args.kv_tier_secret_file),
        ),
    )
    priors = Profile(
        f"{name}, the tiers' start-up priors (before any read is observed)",
        config.block_size,
        block_bytes,
        prefill,
        {"host": HOST_READ_COST, "disk": DISK_READ_COST},
    )
    gpu = gpu_profile()
    print("\n".join(format_report([machine, priors, gpu], gpu)))
    if json_path:
        json_path.write_text(json.dumps(report_json([machine, priors, gpu], gpu), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def _model_dir(model: Optional[str]) -> Path:
    if model is None:
        from ..model import ensure_default_model

        return ensure_default_model()
    from ..model.weights.named_models import resolve_model

    return resolve_model(model)
