"""Every operator route sits under one guard (issue 25): the admin_only dependency of api.admin_router, never a
check a handler could forget; /metrics likewise under api.metrics_router's. Structural (the app serves only the
open, the metrics and the admin groups, admin paths only in the guarded ones) and behavioural (no key, a tenant's
key, a wrong key: refused before any input is read; the admin key from x-api-key as from a Bearer header)."""

import httpx
import pytest
from fastapi.routing import APIRoute
from server_helpers import LiveServer

from prefixserve.server.api import (
    ADMIN_ROUTE_GROUPS,
    METRICS_ROUTE_GROUPS,
    OPEN_ROUTE_GROUPS,
    admin_router,
    metrics_router,
)
from prefixserve.server.auth import admin_only, metrics_readers_only

ADMIN = "guard-admin-key"
ADMIN_PATHS = (
    "/v1/kv_events",
    "/v1/cache",
    "/v1/admin",
    "/dashboard/api/",
    "/v1/load_lora_adapter",  # vLLM's names for the runtime LoRA routes
    "/v1/unload_lora_adapter",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("guard") / "keys.json"
    keys.write_text('{"tenant-key": "tenant-a"}')
    with LiveServer("--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--enable-kv-events") as live:
        yield live


def routes_of(groups) -> list[APIRoute]:
    return [route for group in groups for route in group.routes if isinstance(route, APIRoute)]


def test_admin_paths_live_only_in_the_guarded_groups():
    assert [depends.dependency for depends in admin_router().dependencies] == [admin_only]
    admin = routes_of(ADMIN_ROUTE_GROUPS)
    assert len(admin) >= 12  # kv_events, cache keys/stats/info, pins x3, reload, dashboard snapshot, 4 what-ifs
    assert [route.path for route in admin if not route.path.startswith(ADMIN_PATHS)] == []
    assert [route.path for route in routes_of(OPEN_ROUTE_GROUPS) if route.path.startswith(ADMIN_PATHS)] == []
    assert not any(route.dependencies for route in admin)  # no handler-level copy of the check to drift
    assert [depends.dependency for depends in metrics_router().dependencies] == [metrics_readers_only]
    assert [route.path for route in routes_of(METRICS_ROUTE_GROUPS)] == ["/metrics"]
    assert "/metrics" not in [route.path for route in routes_of(OPEN_ROUTE_GROUPS)]


def test_the_app_serves_nothing_outside_those_groups(server):
    served = set(server.app.openapi()["paths"])
    # a {name:path} parameter appears as {name} in the schema
    groups = OPEN_ROUTE_GROUPS + METRICS_ROUTE_GROUPS + ADMIN_ROUTE_GROUPS
    known = {route.path.replace(":path}", "}") for route in routes_of(groups)}
    assert served <= known, served - known  # a router included some other way would show here


@pytest.mark.parametrize(
    "key, status, code",
    [(None, 401, "invalid_api_key"), ("tenant-key", 403, "admin_only"), ("wrong", 401, "invalid_api_key")],
)
def test_each_admin_route_refuses_anyone_but_the_operator_before_reading_its_input(server, key, status, code):
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    for route in routes_of(ADMIN_ROUTE_GROUPS):
        path = route.path.replace("{pin_id}", "no-such-pin")
        for method in sorted(route.methods):
            # a malformed query and body too: the guard answers before any validation would
            response = httpx.request(
                method,
                server.url + path,
                params={"since": "abc", "max_nodes": "x"},
                content=b"{not json",
                headers=headers,
                timeout=30,
            )
            assert response.status_code == status, (method, path, response.status_code, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, (method, path)


@pytest.mark.parametrize("key", [None, "tenant-key", "wrong"])
def test_a_tenants_x_api_key_is_refused_as_its_bearer_key_is(server, key):
    headers = {"x-api-key": key} if key else {}
    status, code = (403, "admin_only") if key == "tenant-key" else (401, "invalid_api_key")
    response = httpx.get(server.url + "/v1/cache/info", headers=headers, timeout=30)
    assert response.status_code == status and response.json()["error"]["code"] == code, response.text


def test_the_operator_passes_the_guard(server):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(server.url + "/v1/cache/info", headers=headers, timeout=30).status_code == 200
    assert httpx.get(server.url + "/v1/cache/info", headers={"x-api-key": ADMIN}, timeout=30).status_code == 200
    both = {"x-api-key": ADMIN, "Authorization": "Bearer tenant-key"}  # two different keys: which one asks?
    ambiguous = httpx.get(server.url + "/v1/cache/info", headers=both, timeout=30)
    assert ambiguous.status_code == 400 and ambiguous.json()["error"]["code"] == "ambiguous_authorization"
    assert httpx.get(server.url + "/dashboard/api/snapshot?tree=false", headers=headers, timeout=30).status_code == 200
    bad = httpx.get(server.url + "/v1/kv_events", params={"since": "abc"}, headers=headers, timeout=30)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "since"  # past the guard: its own check
