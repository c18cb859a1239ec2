"""GET /dashboard (the page, no key needed: it holds no data) and GET /dashboard/api/snapshot (admin key only).

The snapshot reveals cache state (block key prefixes, tenant ids, hit rates), so it answers
the operator's admin key alone, like /v1/cache/keys; without --admin-api-key it is off (404
admin_disabled) and the page says how to turn it on.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response

from ...cache.tree_view import DEFAULT_MAX_NODES
from ...http import APIError
from .assets import NO_CACHE, page_html, static_file
from .snapshot import build_snapshot

MAX_TREE_NODES = 2000

dashboard_routes = APIRouter()  # the page and its files: open (the page asks for the key)
dashboard_api_routes = APIRouter()  # its data: mounted under the admin guard (api.admin_router)


@dashboard_routes.get("/dashboard", include_in_schema=False)
async def dashboard_page():
    return HTMLResponse(page_html("server"), headers=NO_CACHE)


@dashboard_routes.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_static(name: str):
    try:
        content, media_type = static_file(name)
    except KeyError:
        raise APIError(404, f"no dashboard file {name!r}", "not_found_error", code="not_found") from None
    return Response(content, media_type=media_type, headers=NO_CACHE)


@dashboard_api_routes.get("/dashboard/api/snapshot")
async def dashboard_snapshot(
    request: Request, tree: bool = True, max_nodes: int = Query(DEFAULT_MAX_NODES, ge=2, le=MAX_TREE_NODES)
):
    """Counters as /metrics has them, pool pressure, TTFT by hit/miss, tenants and (with tree=true) the radix tree."""
    return await build_snapshot(request.app.state.server, include_tree=tree, max_nodes=max_nodes)
