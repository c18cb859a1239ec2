"""`prefixserve route`: the cache-aware HTTP router in front of `prefixserve serve` replicas."""

from __future__ import annotations

import argparse
import logging

from ..http_body import DEFAULT_MAX_REQUEST_BYTES
from ..http_keys import load_api_keys
from .costs import CostModel
from .policies import POLICIES


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a replica's base URL, optionally named, e.g. gpu-a=http://127.0.0.1:8001 (repeat for "
        "each; unnamed ones are replica-0, replica-1, ...). Clients and metrics see only names",
    )
    parser.add_argument(
        "--prefill-replica",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a replica started with --role prefill: each request's prompt is computed there first "
        "(chosen as --policy chooses), its KV handed over the remote tier (repeat for each)",
    )
    parser.add_argument(
        "--decode-replica",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a replica started with --role decode: it generates, fetching the prompt's KV it lacks "
        "from the remote tier; chosen by the prefix it holds (repeat for each)",
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with --prefill-replica: a prompt of which the decode replica it would go to lacks at "
        "most N tokens is prefilled there, not handed over (short prefills are not worth the "
        "hand-off; `prefixserve simulate --pd-local-prefill` sizes it) (default: 0, all)",
    )
    parser.add_argument(
        "--max-prefill-queue-seconds",
        type=float,
        default=None,
        metavar="S",
        help="with --prefill-replica: while every prefill replica has more than S seconds of work "
        "outstanding, prompts are prefilled on their decode replica (a backed-up prefill pool "
        "is not worth waiting for) (default: no limit)",
    )
    parser.add_argument(
        "--policy",
        default="kv_aware",
        choices=sorted(POLICIES),
        help="how a replica is chosen: kv_aware sends a request where its prefix is cached, unless "
        "that replica is overloaded",
    )
    parser.add_argument(
        "--model", default=None, help="the replicas' checkpoint directory (for its tokenizer); default built-in"
    )
    parser.add_argument(
        "--api-keys-file", default=None, help="the replicas' keys file, so tenants route to their own prefixes"
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help="the replicas' --admin-api-key, sent on the router's own calls (KV events, cache keys); "
        "without it the router routes by load only. It opens the router's /metrics and dashboard too",
    )
    parser.add_argument(
        "--metrics-api-key",
        default=None,
        help="a Prometheus scraper's key for the router's /metrics, and nothing else: with "
        "--api-keys-file, /metrics answers only this key or --admin-api-key (default: none)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read (default %(default)d)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="distinct replicas a request (or a broken stream) may try (default %(default)d)",
    )
    parser.add_argument(
        "--health-failure-threshold",
        type=int,
        default=3,
        help="/health checks timing out in a row that mark a replica down; a refused or reset "
        "connection marks it down at once (default %(default)d)",
    )
    parser.add_argument(
        "--progress-timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="a stream that has begun and sends nothing this long is moved to another replica, "
        "continued from its tokens (default: the slowest gap between chunks seen + 3 s, at "
        "least 5 s)",
    )
    parser.add_argument(
        "--cache-key-slack",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="requests sharing a prompt_cache_key stay on one replica until it has this many "
        "seconds of work more than the least loaded one, then overflow to --policy",
    )
    parser.add_argument(
        "--kv-remote-url",
        metavar="URL",
        default=None,
        help="the replicas' --kv-remote-url: kv_aware prices what the shared remote tier holds, so a "
        "request may go to an idle replica that fetches its prefix (default: off)",
    )
    parser.add_argument("--costs", default=None, help="cost model JSON (prefixserve simulate --calibrate writes one)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="listen port")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="router and uvicorn logging",
    )


def settings_from_args(args: argparse.Namespace):
    from .settings import RouterSettings

    try:
        return RouterSettings(
            replicas=tuple(args.replica),
            prefill_replicas=tuple(args.prefill_replica),
            decode_replicas=tuple(args.decode_replica),
            local_prefill_tokens=args.local_prefill_tokens,
            max_prefill_queue_seconds=args.max_prefill_queue_seconds,
            policy=args.policy,
            model=args.model,
            api_keys=load_api_keys(args.api_keys_file),
            admin_api_key=args.admin_api_key,
            metrics_api_key=args.metrics_api_key,
            cost=CostModel.load(args.costs) if args.costs else CostModel(),
            max_attempts=args.max_attempts,
            health_failure_threshold=args.health_failure_threshold,
            progress_timeout=args.progress_timeout,
            kv_remote_url=args.kv_remote_url,
            max_request_bytes=args.max_request_bytes,
            cache_key_slack=args.cache_key_slack,
        )
    except ValueError as error:
        raise SystemExit(f"prefixserve route: {error}") from None


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at info: a line per health check and KV-event poll, several a second.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def route(args: argparse.Namespace) -> int:
    import uvicorn

    from ..http_protocol import uvicorn_config
    from .app import build_router_app

    configure_logging(args.log_level)
    settings = settings_from_args(args)
    app = build_router_app(settings)
    logging.getLogger("prefixserve.router").info(
        "routing %s over %s on http://%s:%d",
        args.policy,
        ", ".join(name for name, _ in settings.named_replicas()),
        args.host,
        args.port,
    )
    uvicorn.Server(uvicorn_config(app, args.host, args.port, args.log_level)).run()
    return 0
