"""`prefixserve route`: the cache-aware HTTP router in front of `prefixserve serve` replicas."""

from __future__ import annotations

import argparse
import logging

from .costs import CostModel
from .policies import POLICIES


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", required=True, metavar="URL",
                        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    parser.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES))
    parser.add_argument("--model", default=None, help="the replicas' checkpoint directory (for its tokenizer); default built-in")
    parser.add_argument("--api-keys-file", default=None, help="the replicas' keys file, so tenants route to their own prefixes")
    parser.add_argument("--costs", default=None, help="cost model JSON (prefixserve simulate --calibrate writes one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="info")


def settings_from_args(args: argparse.Namespace):
    from ..server.launch import load_api_keys
    from .app import RouterSettings

    return RouterSettings(
        replicas=tuple(args.replica),
        policy=args.policy,
        model=args.model,
        api_keys=load_api_keys(args.api_keys_file),
        cost=CostModel.load(args.costs) if args.costs else CostModel(),
    )


def route(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_router_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_router_app(settings_from_args(args))
    logging.getLogger("prefixserve.router").info("routing %s over %s on http://%s:%d", args.policy,
                                                 ", ".join(args.replica), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
