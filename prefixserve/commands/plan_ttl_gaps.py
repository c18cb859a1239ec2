"""Where `prefixserve plan ttl` reads its reuse gaps: a trace, a running server's /v1/cache/stats, or a file
(a list of gap seconds or a saved stats body); each becomes a GapSource for the planner (plan/ttl.py)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple, Optional

from ..plan.gap_distribution import GapDistribution
from ..plan.gap_readers import distribution_from_stats, gaps_from_trace
from .plan_ttl_report import _duration
from .server_get import get_from_server

STATS_PATH = "/v1/cache/stats"


class GapSource(NamedTuple):
    distribution: GapDistribution
    description: str
    prefix_tokens: Optional[float] = None  # measured by the source, when it says
    releases_per_second: Optional[float] = None


def read_gaps(args: argparse.Namespace) -> GapSource:
    if args.trace:
        from ..traces.named import load_trace

        trace = load_trace(args.trace)
        found = gaps_from_trace(trace.requests, trace.block_size)
        return GapSource(
            found.distribution,
            f"trace {trace.name} ({len(trace):,} requests over {_duration(trace.duration)})",
            found.mean_reused_prefix_tokens or None,
            found.releases_per_second,
        )
    if args.url:
        return _from_stats(
            fetch_stats(args.url, args.admin_api_key), f"{args.url.rstrip('/')}{STATS_PATH}", args.tenant
        )
    path = Path(args.gaps)
    if not path.is_file():
        raise FileNotFoundError(
            f"--gaps {args.gaps}: no such file; pass a list of gap seconds or a saved {STATS_PATH} body"
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _numbers(text, args.gaps)
    if isinstance(data, dict):
        if args.num_never_returned is not None:
            raise ValueError(
                f"--num-never-returned goes with a list of gaps; the stats in --gaps {args.gaps} "
                f"count their own (num_releases minus count)"
            )
        return _from_stats(data, f"--gaps {args.gaps}", args.tenant)
    if not isinstance(data, list):
        raise ValueError(
            f"--gaps {args.gaps}: JSON {type(data).__name__}, not a list of gap seconds or a {STATS_PATH} object"
        )
    if args.tenant is not None:
        raise ValueError(f"--tenant needs cache stats; --gaps {args.gaps} is a plain list of gaps")
    try:
        distribution = GapDistribution.from_samples(data, args.num_never_returned or 0)
    except ValueError as error:
        raise ValueError(f"--gaps {args.gaps}: {error}") from None
    return GapSource(distribution, f"--gaps {args.gaps} ({len(data):,} gaps)")


def _numbers(text: str, name: str) -> list[float]:
    parts = [part for part in re.split(r"[\s,]+", text) if part]
    try:
        return [float(part) for part in parts]
    except ValueError:
        raise ValueError(
            f"--gaps {name}: neither JSON nor numbers separated by spaces, commas or lines; "
            f"pass gap seconds or a saved {STATS_PATH} body"
        ) from None


def _from_stats(stats, description: str, tenant: Optional[str]) -> GapSource:
    distribution = distribution_from_stats(stats, tenant)
    prefix_tokens = stats.get("mean_reused_prefix_tokens")
    usable = isinstance(prefix_tokens, (int, float)) and not isinstance(prefix_tokens, bool) and prefix_tokens > 0
    label = f"{description}" + (f", tenant {tenant}" if tenant is not None else "")
    return GapSource(distribution, label, float(prefix_tokens) if usable else None)


def fetch_stats(url: str, admin_api_key: Optional[str], transport=None) -> dict:
    """GET the server's cache stats; any failure is a ValueError naming what to check."""
    address, response = get_from_server(url, STATS_PATH, admin_api_key, transport)
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        hint = "" if admin_api_key else "; pass --admin-api-key"
        raise ValueError(f"--url: {address} answered {response.status_code}: {message or response.text[:200]}{hint}")
    if not isinstance(body, dict):
        raise ValueError(f"--url: {address} did not answer a JSON object; is it a prefixserve server?")
    return body
