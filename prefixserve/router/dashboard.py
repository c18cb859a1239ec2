"""The router's /dashboard: the server's page in fleet mode, and GET /dashboard/api/fleet (router admin key).

One row per replica: health, in-flight requests and estimated load, its token hit rate (read from
the replica's own /metrics with the router's admin key, which a replica with tenant keys asks for)
and the share of requests routed to it; and the fleet's totals. The page's files are read from
package data by path, so the router imports nothing from server/ (see docs/design.md).
"""

from __future__ import annotations

import asyncio
import re
import time
from importlib import resources
from typing import Optional

import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response

from ..http import error_response
from ..metric_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, total

STATIC_NAME = re.compile(r"[a-z]+\.(js|css)")
MEDIA_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
NO_CACHE = {"Cache-Control": "no-cache"}
QUERIES, HITS = total(PREFIX_CACHE_QUERIES), total(PREFIX_CACHE_HITS)  # samples of a replica's /metrics


async def fleet_admin_only(request: Request) -> None:
    """The dependency the fleet's data is mounted under: the router's admin key, checked before any handler."""
    router = request.app.state.router
    router.admin.require(request.headers, router.keys)


fleet_dashboard_routes = APIRouter()  # the page and its files: open (the page asks for the key)
fleet_admin_routes = APIRouter(dependencies=[Depends(fleet_admin_only)])  # every route with the fleet's data


def _static_dir():
    return resources.files("prefixserve").joinpath("server", "dashboard", "static")


@fleet_dashboard_routes.get("/dashboard", include_in_schema=False)
async def fleet_page():
    html = _static_dir().joinpath("index.html").read_text(encoding="utf-8")
    return HTMLResponse(html.replace('data-mode="server"', 'data-mode="fleet"', 1), headers=NO_CACHE)


@fleet_dashboard_routes.get("/dashboard/static/{name}", include_in_schema=False)
async def fleet_static(name: str):
    path = _static_dir().joinpath(name)
    if not STATIC_NAME.fullmatch(name) or not path.is_file():
        return error_response(404, f"no dashboard file {name!r}", "not_found_error", code="not_found")
    return Response(path.read_bytes(), media_type=MEDIA_TYPES[name.rsplit(".", 1)[1]], headers=NO_CACHE)


async def replica_hits(
    client: httpx.AsyncClient, url: str, headers: dict, timeout: float
) -> Optional[tuple[float, float]]:
    """(prompt tokens looked up, tokens hit) from a replica's /metrics; None when it does not answer them."""
    try:
        response = await client.get(url + "/metrics", headers=headers, timeout=timeout)
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    values = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in (QUERIES, HITS):
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values[QUERIES], values[HITS]


@fleet_admin_routes.get("/dashboard/api/fleet")
async def fleet_snapshot(request: Request):
    router = request.app.state.router
    replicas = router.replicas
    headers = router.control_headers()  # the replicas' admin key: a replica with tenant keys asks for it
    answers = await asyncio.gather(
        *(
            replica_hits(router.client, r.url, headers, router.settings.control_timeout) if r.healthy else _nothing()
            for r in replicas
        )
    )
    total_routed = sum(r.num_routed for r in replicas)
    rows = []
    for replica, hits in zip(replicas, answers):
        queried, hit = hits if hits is not None else (None, None)
        rows.append(
            {
                "name": replica.name,
                "url": replica.url,
                "healthy": replica.healthy,
                "in_flight": len(replica.outstanding),
                "load_seconds": replica.load,
                "num_routed": replica.num_routed,
                "routed_share": replica.num_routed / total_routed if total_routed else 0.0,
                "predicted_hit_tokens": replica.num_predicted_hit_tokens,
                "mirrors_cache": replica.can_mirror,
                "prompt_tokens": queried,
                "hit_tokens": hit,
                "hit_rate": hit / queried if queried else None,
                "model_fingerprint": replica.version,
                "last_down_reason": replica.down_reasons[-1].reason if replica.down_reasons else None,
            }
        )
    answered = [row for row in rows if row["prompt_tokens"] is not None]
    queried = sum(row["prompt_tokens"] for row in answered)
    hit = sum(row["hit_tokens"] for row in answered)
    totals = {
        "num_replicas": len(rows),
        "num_healthy": sum(row["healthy"] for row in rows),
        "in_flight": sum(row["in_flight"] for row in rows),
        "load_seconds": sum(row["load_seconds"] for row in rows),
        "num_routed": total_routed,
        "prompt_tokens": queried,
        "hit_tokens": hit,
        "hit_rate": hit / queried if queried else None,
    }
    versions = router.model_versions()
    return {
        "mode": "fleet",
        "time": time.time(),
        "policy": router.settings.policy,
        "replicas": rows,
        "totals": totals,
        "model_versions": versions,
        "mixed_versions": len(versions) > 1,
    }


async def _nothing() -> None:
    return None
