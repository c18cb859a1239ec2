"""The HTTP router: an OpenAI- and Anthropic-compatible front door for replicas started with `prefixserve serve`.

It tokenizes each request with the replicas' tokenizer, chat template and scope,
so its block keys equal theirs; asks the routing policy which replica should
serve it (kv_aware: the one that holds the longest prefix, unless that one is
overloaded); and passes the request through (forward.py). A replica that stops
answering is taken out and the request retried elsewhere; a stream it was
serving is continued elsewhere (stream_relay.py; an Anthropic Messages stream is
replayed if nothing of it was sent yet, message_streams.py); health checks bring
it back.

Whatever a client sends, the router answers with an error body of the API asked
(OpenAI's, Anthropic's on /v1/messages): a 4xx for what it cannot forward, the
replica's own answer otherwise, and a 500 body (never plain text) should the router
itself fail.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..http import error_response, install_base_error_handlers
from ..http_body import BodySizeLimit
from ..http_keys import MetricsReaders
from .dashboard import fleet_admin_routes, fleet_dashboard_routes
from .fleet import Router
from .forward import ask_any_replica, forward
from .response_affinity import RESPONSES_PATH, ResponseLedger, create_response, stored_response
from .settings import RouterSettings

__all__ = ["Router", "RouterSettings", "build_router_app"]
logger = logging.getLogger("prefixserve.router")


# Requests placed by their prompt's tokens (forward.py; all POST), and those any healthy replica answers alike
# (the replicas serve the same model and tokenizer), as (method, path).
PLACED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
ANY_REPLICA_ROUTES = (
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model:path}"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
)


def _add_relayed_routes(app: FastAPI, router: Router) -> None:
    def placed(path: str):
        async def endpoint(request: Request):
            return await forward(router, request, path)

        return endpoint

    def any_replica(path: str):
        async def endpoint(request: Request):
            return await ask_any_replica(router, request, request.url.path)  # the path as asked: /v1/models/NAME

        return endpoint

    for path in PLACED_ROUTES:
        app.add_api_route(path, placed(path), methods=["POST"])
    for method, path in ANY_REPLICA_ROUTES:
        app.add_api_route(path, any_replica(path), methods=[method])

    ledger = ResponseLedger()  # each stored response's replica and conversation (response_affinity.py)

    async def new_response(request: Request):
        return await create_response(router, ledger, request)

    async def one_response(request: Request):
        return await stored_response(router, ledger, request, request.url.path)

    app.add_api_route(RESPONSES_PATH, new_response, methods=["POST"])
    app.add_api_route(RESPONSES_PATH + "/{response_id}", one_response, methods=["GET", "DELETE"])
    app.add_api_route(RESPONSES_PATH + "/{response_id}/input_items", one_response, methods=["GET"])


async def metrics_readers_only(request: Request) -> None:
    """The dependency the router's /metrics is mounted under: open without tenant keys, else the router's admin
    or metrics key (MetricsReaders), checked before the handler runs."""
    request.app.state.metrics_readers.require(request.headers)


def build_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @asynccontextmanager
    async def lifespan(_app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="prefixserve router", lifespan=lifespan)
    app.state.router = router
    # per-replica routed requests and predicted hit tokens rise by each tenant's traffic: the operator's only
    app.state.metrics_readers = MetricsReaders(router.keys, router.admin, settings.metrics_api_key)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)

    install_base_error_handlers(app, logger, "router", code="router_error")
    app.include_router(fleet_dashboard_routes)  # GET /dashboard (fleet mode) and its files
    app.include_router(fleet_admin_routes)  # GET /dashboard/api/fleet, under the router's admin key

    _add_relayed_routes(app, router)

    @app.get("/health")
    async def health():
        healthy = [r.name for r in router.replicas if r.healthy]
        if not healthy:
            return error_response(503, "no healthy replica", "server_error", code="no_replica")
        versions = router.model_versions()
        # A fleet serving two model versions at once (a rolling deploy under way) says so.
        return {"status": "ok", "healthy_replicas": healthy, "model_versions": versions, "mixed": len(versions) > 1}

    @app.get("/metrics", dependencies=[Depends(metrics_readers_only)])
    async def metrics():
        router.refresh_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
