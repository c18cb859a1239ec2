"""`prefixserve plan ttl`: read reuse gaps (a server's cache stats, a file, a trace), price candidate TTLs
with plan/ttl.py (pure computation), print the table and the recommendation, optionally plot and write JSON.
The gaps are read in commands/plan_ttl_gaps.py; the table, JSON and plot are made in commands/plan_ttl_report.py."""

from __future__ import annotations

import argparse
import json
import re
from typing import Optional

from ..plan.tiers import GPU_PREFILL_TOKENS_PER_SECOND, REFERENCE_PREFIX_TOKENS
from ..plan.ttl import (
    DEFAULT_GPU_USD_PER_HOUR,
    DEFAULT_MEMORY_USD_PER_GIB_HOUR,
    DEFAULT_TTLS_SECONDS,
    CostModel,
    plan_ttl,
)
from .paths import output_path
from .plan_ttl_gaps import read_gaps
from .plan_ttl_report import _duration, format_plan, plan_json, plot_plan

PLAN_TTL_SUMMARY = (
    "recommend how long to keep a released prefix: per candidate TTL, the chance the next turn "
    "still finds it, the cold prefill of the misses and the memory held, priced in USD an hour"
)
STATED_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B in bfloat16, as plan tiers' stated GPU profile
STATED_RELEASES_PER_SECOND = 1.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*$")
_UNIT_SECONDS = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def add_plan_ttl_arguments(actions, formatter_class: type) -> None:
    """The `ttl` action under `prefixserve plan`; `actions` is plan's subparsers object."""
    ttl = actions.add_parser(
        "ttl", help=PLAN_TTL_SUMMARY, description=PLAN_TTL_SUMMARY, allow_abbrev=False, formatter_class=formatter_class
    )
    ttl.set_defaults(usage_error=ttl.error)
    source = ttl.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--gaps",
        metavar="FILE",
        help="gap seconds as a JSON list or numbers separated by spaces, commas or lines; or the JSON "
        "body of a server's GET /v1/cache/stats",
    )
    source.add_argument("--url", metavar="URL", help="a running 'prefixserve serve': fetch its /v1/cache/stats")
    source.add_argument(
        "--trace",
        metavar="NAME|FILE",
        help="a Mooncake trace (built in: conversation, synthetic); a gap is the time from a request "
        "to the next one that starts with its whole prefix",
    )
    ttl.add_argument("--admin-api-key", metavar="KEY", help="the server's admin key, for --url (default: none sent)")
    ttl.add_argument("--tenant", metavar="ID", help="plan from this tenant's gaps in the stats (default: all tenants)")
    ttl.add_argument(
        "--num-never-returned",
        type=float,
        metavar="N",
        help="with a list of gaps: releases whose prefix was never reused in the window (default: 0; "
        "stats and traces count their own)",
    )
    ttl.add_argument(
        "--ttls",
        default=",".join(_duration(ttl) for ttl in DEFAULT_TTLS_SECONDS).replace(" ", ""),
        metavar="LIST",
        help="candidate TTLs, comma-separated, in seconds or with a unit: 90, 5m, 2h, 1d",
    )
    ttl.add_argument(
        "--prefix-tokens",
        type=float,
        metavar="N",
        help=f"mean prefix a returning turn reuses (default: the stats' or the trace's mean; "
        f"{REFERENCE_PREFIX_TOKENS:,}, stated, for a list of gaps)",
    )
    ttl.add_argument(
        "--prefill-seconds-per-token",
        type=float,
        metavar="SECONDS",
        help="GPU seconds to prefill one token (default: Llama-3-8B on one H100 at "
        f"{GPU_PREFILL_TOKENS_PER_SECOND:,.0f} tokens/s, stated)",
    )
    ttl.add_argument(
        "--kv-bytes-per-token",
        type=float,
        metavar="BYTES",
        help=f"KV bytes of one token, all layers (default: {STATED_KV_BYTES_PER_TOKEN:,}, Llama-3-8B "
        f"in bfloat16, stated)",
    )
    ttl.add_argument(
        "--releases-per-second",
        type=float,
        metavar="RATE",
        help="prefix releases (finished turns) a second; scales memory and dollars, not the "
        f"recommendation (default: the trace's rate; {STATED_RELEASES_PER_SECOND:g}, stated, "
        "otherwise)",
    )
    ttl.add_argument(
        "--gpu-usd-per-hour",
        type=float,
        default=DEFAULT_GPU_USD_PER_HOUR,
        metavar="USD",
        help="price of the GPU time that re-prefills a miss",
    )
    ttl.add_argument(
        "--memory-usd-per-gib-hour",
        type=float,
        default=DEFAULT_MEMORY_USD_PER_GIB_HOUR,
        metavar="USD",
        help="price of holding a GiB of KV for an hour (default: an H100's 80 GiB "
        f"of HBM pro rata, {DEFAULT_MEMORY_USD_PER_GIB_HOUR:.4g}; DRAM is ~10x less)",
    )
    ttl.add_argument(
        "--waiting-usd-per-second",
        type=float,
        default=0.0,
        metavar="USD",
        help="what a second of extra TTFT costs you, per user kept waiting; 0 leaves waiting unpriced",
    )
    ttl.add_argument("--plot", metavar="FILE.png", help="also plot hit rate and cost against TTL (default: no plot)")
    ttl.add_argument("--json", metavar="FILE", help="also write the plan here (default: no JSON)")


def plan_ttl_command(args: argparse.Namespace) -> int:
    """Raises OSError or ValueError with a one-line message on bad input; plan() turns them into exit code 2."""
    ttls = parse_ttls(args.ttls)
    cost = CostModel(args.gpu_usd_per_hour, args.memory_usd_per_gib_hour, args.waiting_usd_per_second)
    plot_path = output_path("--plot", args.plot) if args.plot else None
    json_path = output_path("--json", args.json) if args.json else None
    if args.tenant is not None and args.trace:
        raise ValueError("--tenant needs cache stats (--gaps STATS.json or --url); a trace has no tenants")
    if args.num_never_returned is not None and not args.gaps:
        raise ValueError("--num-never-returned goes with a list of --gaps; stats and traces count their own")
    source = read_gaps(args)
    kind = "trace's" if args.trace else "stats'"
    prefix_tokens, prefix_from = _chosen(
        args.prefix_tokens,
        (source.prefix_tokens, f"the {kind} mean"),
        (REFERENCE_PREFIX_TOKENS, "stated; pass --prefix-tokens"),
    )
    prefill, prefill_from = _chosen(
        args.prefill_seconds_per_token,
        (
            1 / GPU_PREFILL_TOKENS_PER_SECOND,
            f"stated: Llama-3-8B on one H100 at {GPU_PREFILL_TOKENS_PER_SECOND:,.0f} "
            f"tokens/s; pass --prefill-seconds-per-token",
        ),
    )
    kv_bytes, kv_from = _chosen(
        args.kv_bytes_per_token,
        (STATED_KV_BYTES_PER_TOKEN, "stated: Llama-3-8B in bfloat16; pass --kv-bytes-per-token"),
    )
    rate, rate_from = _chosen(
        args.releases_per_second,
        (source.releases_per_second, "the trace's rate"),
        (STATED_RELEASES_PER_SECOND, "stated; scales memory and dollars, not the choice"),
    )
    plan = plan_ttl(
        source.distribution,
        ttls,
        prefix_tokens=prefix_tokens,
        prefill_seconds_per_token=prefill,
        kv_bytes_per_token=kv_bytes,
        releases_per_second=rate,
        cost=cost,
    )
    inputs = {
        "prefix_tokens": prefix_from,
        "prefill_seconds_per_token": prefill_from,
        "kv_bytes_per_token": kv_from,
        "releases_per_second": rate_from,
    }
    print("\n".join(format_plan(plan, source.description, inputs)))
    if plot_path:
        plot_plan(plan, plot_path, source.description)
        print(f"wrote {plot_path}")
    if json_path:
        json_path.write_text(json.dumps(plan_json(plan, source.description, inputs), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def _chosen(given: Optional[float], *fallbacks: tuple[Optional[float], str]) -> tuple[float, str]:
    """The flag's value when given, else the first fallback the source has, with where it came from."""
    if given is not None:
        return given, "given"
    return next((value, label) for value, label in fallbacks if value)


def parse_ttls(text: str) -> list[float]:
    ttls = []
    for part in (part for part in text.split(",") if part.strip()):
        match = _DURATION.match(part)
        if not match or not float(match.group(1)) > 0:
            raise ValueError(f"--ttls: {part.strip()!r} is not a positive duration; write seconds or 90s, 5m, 2h, 1d")
        ttls.append(float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if not ttls:
        raise ValueError("--ttls lists no TTL; give comma-separated durations such as 60,5m,1h")
    return ttls
