"""`prefixserve plan price`: the vendors' blended input price and the TTFT at a hit rate and prompt length,
given or measured on a running server (its /metrics), computed by plan/price.py (pure computation)."""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple, Optional

from ..metric_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_REQUESTS, TTFT, total
from ..plan.price import estimated_ttft, fixed_seconds_from_measured, format_price_table, price_json, price_table
from ..plan.tiers import GPU_PREFILL_TOKENS_PER_SECOND
from .paths import output_path
from .server_get import get_from_server

PLAN_PRICE_SUMMARY = (
    "print what a prompt costs at each vendor's list prices for cached and fresh input, and the "
    "TTFT, at a given hit rate and prompt length or those measured on a running server"
)
METRICS_PATH = "/metrics"


class Measured(NamedTuple):
    hit_rate: float
    mean_prompt_tokens: float
    num_requests: float
    mean_ttft_seconds: Optional[float]


def add_plan_price_arguments(actions, formatter_class: type) -> None:
    """The `price` action under `prefixserve plan`; `actions` is plan's subparsers object."""
    price = actions.add_parser(
        "price",
        help=PLAN_PRICE_SUMMARY,
        description=PLAN_PRICE_SUMMARY,
        allow_abbrev=False,
        formatter_class=formatter_class,
    )
    price.set_defaults(usage_error=price.error)
    price.add_argument(
        "--hit-rate",
        type=float,
        metavar="FRACTION",
        help="token hit rate in [0, 1] (default: the server's, with --url; else 0.5)",
    )
    price.add_argument(
        "--prompt-tokens",
        type=float,
        metavar="N",
        help="prompt length in tokens (default: the server's mean, with --url; else 2,000)",
    )
    price.add_argument(
        "--url",
        metavar="URL",
        help="a running 'prefixserve serve': read its hit rate, mean prompt length and mean TTFT from /metrics",
    )
    price.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="sent as a bearer token with --url: the server's admin or metrics key, which its /metrics "
        "needs where tenants have keys",
    )
    price.add_argument(
        "--prefill-seconds-per-token",
        type=float,
        default=1 / GPU_PREFILL_TOKENS_PER_SECOND,
        metavar="SECONDS",
        help=f"prefill cost of one token, for the TTFT (default: Llama-3-8B on one "
        f"H100 at {GPU_PREFILL_TOKENS_PER_SECOND:,.0f} tokens/s, stated)",
    )
    price.add_argument(
        "--write-fraction",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="share of uncached tokens a vendor with a cache-write price charges at it (default 1: "
        "every miss is written, as this server caches every full block)",
    )
    price.add_argument("--json", metavar="FILE", help="also write the table here (default: no JSON)")


def plan_price_command(args: argparse.Namespace) -> int:
    """Raises OSError or ValueError with a one-line message on bad input; plan() turns them into exit code 2."""
    json_path = output_path("--json", args.json) if args.json else None
    measured = fetch_measured(args.url, args.admin_api_key) if args.url else None
    if measured is not None and not measured.num_requests and (args.hit_rate is None or args.prompt_tokens is None):
        raise ValueError(
            f"--url: {args.url} has served no request yet, so there is nothing measured; send it "
            "traffic or pass --hit-rate and --prompt-tokens"
        )
    hit_rate = args.hit_rate if args.hit_rate is not None else (measured.hit_rate if measured else 0.5)
    prompt_tokens = (
        args.prompt_tokens if args.prompt_tokens is not None else (measured.mean_prompt_tokens if measured else 2000.0)
    )
    fixed = 0.0
    if measured is not None and measured.mean_ttft_seconds is not None:
        fixed = fixed_seconds_from_measured(
            measured.mean_ttft_seconds, measured.hit_rate, measured.mean_prompt_tokens, args.prefill_seconds_per_token
        )
    rows = price_table(hit_rate, prompt_tokens, args.write_fraction)  # validates hit rate and prompt length
    ttft = estimated_ttft(hit_rate, prompt_tokens, args.prefill_seconds_per_token, fixed)
    if measured is not None:
        print(
            f"measured on {args.url}: {measured.num_requests:,.0f} requests, token hit rate "
            f"{measured.hit_rate:.1%}, mean prompt {measured.mean_prompt_tokens:,.0f} tokens"
            + (
                f", mean TTFT {measured.mean_ttft_seconds * 1e3:.1f} ms"
                if measured.mean_ttft_seconds is not None
                else ""
            )
        )
    print("\n".join(format_price_table(rows, ttft)))
    if json_path:
        body = {**price_json(rows, ttft), "measured": None if measured is None else measured._asdict()}
        json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    return 0


def parse_metrics(text: str) -> Measured:
    """Hit rate, mean prompt length and mean TTFT from a prefixserve /metrics body (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }
    names = (total(PREFIX_CACHE_QUERIES), total(PREFIX_CACHE_HITS), total(PREFIX_CACHE_REQUESTS))
    missing = [name for name in names if name not in samples]
    if missing:
        raise ValueError(f"--url: /metrics has no {', '.join(missing)}; is it a prefixserve server?")
    query_tokens, hit_tokens, num_requests = (samples[name] for name in names)
    ttft_count = samples.get(TTFT + "_count")
    ttft_sum = samples.get(TTFT + "_sum")
    return Measured(
        hit_tokens / query_tokens if query_tokens else 0.0,
        query_tokens / num_requests if num_requests else 0.0,
        num_requests,
        ttft_sum / ttft_count if ttft_count and ttft_sum is not None else None,
    )


def fetch_measured(url: str, admin_api_key: Optional[str], transport=None) -> Measured:
    """GET the server's /metrics; any failure is a ValueError naming what to check."""
    address, response = get_from_server(url, METRICS_PATH, admin_api_key, transport)
    if response.status_code != 200:
        raise ValueError(f"--url: {address} answered {response.status_code}: {response.text[:200]}")
    return parse_metrics(response.text)
