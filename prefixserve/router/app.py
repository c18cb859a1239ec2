"""The HTTP router: an OpenAI-compatible front door for replicas started with `prefixserve serve`.

It tokenizes each request with the replicas' tokenizer, chat template and scope,
so its block keys equal theirs; asks the routing policy which replica should
serve it (kv_aware: the one that holds the longest prefix, unless that one is
overloaded); and passes the request through (forward.py). A replica that stops
answering is taken out and the request retried elsewhere; a stream it was
serving is continued elsewhere (streams.py); health checks bring it back.

Whatever a client sends, the router answers with an OpenAI-style body: a 4xx for
what it cannot forward, the replica's own answer otherwise, and a 500 body (never
plain text) should the router itself fail.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..http import error_response, install_base_error_handlers
from ..http_body import BodySizeLimit
from ..http_keys import AmbiguousAuthorization, authorization_of, raw_header
from .dashboard import fleet_admin_routes, fleet_dashboard_routes
from .fleet import Router
from .forward import forward, relay_response
from .settings import RouterSettings

__all__ = ["Router", "RouterSettings", "build_router_app"]
logger = logging.getLogger("prefixserve.router")


def build_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @asynccontextmanager
    async def lifespan(_app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="prefixserve router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)

    install_base_error_handlers(app, logger, "router", code="router_error")
    app.include_router(fleet_dashboard_routes)  # GET /dashboard (fleet mode) and its files
    app.include_router(fleet_admin_routes)  # GET /dashboard/api/fleet, under the router's admin key

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(router, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            authorization = authorization_of(request.headers)
        except AmbiguousAuthorization as error:
            return error_response(400, str(error), code="ambiguous_authorization")
        headers = {"authorization": raw_header(authorization)} if authorization is not None else {}
        for replica in router.replicas:
            if not replica.healthy:
                continue
            try:
                response = await router.client.get(replica.url + "/v1/models", headers=headers,
                                                   timeout=settings.control_timeout)
            except httpx.TransportError as failure:
                router.fail_over(replica, failure, "on /v1/models")
                continue
            return relay_response(router, replica, response.status_code, response.headers, response.content)
        return error_response(503, "no healthy replica; retry shortly", "server_error", code="no_replica")

    @app.get("/health")
    async def health():
        healthy = [r.name for r in router.replicas if r.healthy]
        if not healthy:
            return error_response(503, "no healthy replica", "server_error", code="no_replica")
        versions = router.model_versions()
        # A fleet serving two model versions at once (a rolling deploy under way) says so.
        return {"status": "ok", "healthy_replicas": healthy, "model_versions": versions, "mixed": len(versions) > 1}

    @app.get("/metrics")
    async def metrics():
        router.refresh_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
