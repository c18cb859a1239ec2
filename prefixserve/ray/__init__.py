"""prefixserve on Ray Serve: `serve run prefixserve.ray:build_app num_replicas=2 model=DIR`.

`build_app` is an application builder in Ray Serve's convention: engine replicas (one engine each,
resources per replica from its arguments) behind an ingress deployment that serves the OpenAI and
Anthropic routes on Serve's HTTP proxy, routed by our kv_aware policy as the engine deployment's
request router. Needs `pip install "prefixserve[ray]"`; only deployments.py and request_router.py import
Ray, and nothing outside this package imports it.

    app_args.py        the builder's arguments: deployment options and every `serve` flag
    deployments.py     EngineReplica and Ingress
    request_router.py  KVAwareRequestRouter (Ray's custom request router interface)
    replica_views.py   what the router knows of each replica (routing stats, its own routing)
    asgi_call.py       one HTTP request through the replica's app, in process
"""

from __future__ import annotations

from typing import Any, Mapping

from .app_args import parse_app_args

INGRESS_MAX_ONGOING_REQUESTS = 1024  # the ingress only reads and relays: it holds many requests at once


def build_app(args: Mapping[str, Any]):
    """The application `serve run prefixserve.ray:build_app key=value ...` (or a config's `args:`) deploys:
    a ray.serve.Application. Its arguments are checked before Ray is imported (app_args.py)."""
    parsed = parse_app_args(args)
    try:
        from ray import serve
        from ray.serve.config import RequestRouterConfig
    except ImportError as error:
        raise ImportError('prefixserve.ray needs Ray Serve: pip install "prefixserve[ray]"') from error

    from .deployments import EngineReplica, Ingress
    from .request_router import KVAwareRequestRouter

    actor_options: dict[str, Any] = {"num_cpus": parsed.num_cpus, "num_gpus": parsed.num_gpus}
    if parsed.memory is not None:
        actor_options["memory"] = parsed.memory
    router_config = RequestRouterConfig(
        request_router_class=KVAwareRequestRouter, request_routing_stats_period_s=parsed.routing_stats_period_s
    )

    def engines(name: str, num_replicas: int, role: str):
        return serve.deployment(
            name=name,
            num_replicas=num_replicas,
            ray_actor_options=actor_options,
            max_ongoing_requests=parsed.max_ongoing_requests,
            request_router_config=router_config,
        )(EngineReplica).bind(parsed.role_argv(role))

    ingress_options: dict[str, Any] = {"num_cpus": 0}
    if parsed.ingress_resources:
        ingress_options["resources"] = dict(parsed.ingress_resources)
    ingress = serve.deployment(
        name="PrefixserveIngress",
        num_replicas=parsed.ingress_replicas,
        ray_actor_options=ingress_options,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    )(Ingress)
    if not parsed.disaggregated:
        return ingress.bind(engines("PrefixserveEngine", parsed.num_replicas, "both"), parsed.serve_argv)
    return ingress.bind(
        engines("PrefixserveEngine", parsed.num_replicas, "decode"),
        parsed.serve_argv,
        prefill=engines("PrefixservePrefill", parsed.prefill_replicas, "prefill"),
        local_prefill_tokens=parsed.local_prefill_tokens,
    )
