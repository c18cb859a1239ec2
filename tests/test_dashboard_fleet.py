"""The router's fleet dashboard: one row per replica (health, load, hit rate, routed share) and the totals. The
replicas have tenant keys, so their /metrics answers the router's admin key only."""

import json
import time

import httpx
import pytest
from browser_helpers import LiveRouter
from server_helpers import LiveServer, assert_openai_error

KEY = "fleet-dash-admin"
ADMIN = {"Authorization": f"Bearer {KEY}"}
TENANT = {"Authorization": "Bearer fleet-tenant-key"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    keys = tmp_path_factory.mktemp("fleet-keys") / "keys.json"
    keys.write_text(json.dumps({"fleet-tenant-key": "acme"}))
    args = ("--admin-api-key", KEY, "--enable-kv-events", "--api-keys-file", str(keys))
    with LiveServer(*args) as first, LiveServer(*args) as second, LiveRouter([first.url, second.url], KEY) as router:
        yield router, [first, second]


def replica_hits(url: str) -> tuple[float, float]:
    snapshot = httpx.get(url + "/dashboard/api/snapshot?tree=false", headers=ADMIN).json()["metrics"]
    return snapshot["prefixserve:prefix_cache_queries_total"], snapshot["prefixserve:prefix_cache_hits_total"]


def test_fleet_rows_and_totals_follow_the_replicas(fleet):
    router, replicas = fleet
    prompts = [list(range(1, 49)) + [900 + i] * 20 for i in range(4)] + [list(range(500, 560))]
    for prompt in prompts:
        response = httpx.post(
            router.url + "/v1/completions",
            timeout=120,
            headers=TENANT,
            json={"model": "prefixserve-tiny", "prompt": prompt, "max_tokens": 2},
        )
        assert response.status_code == 200, response.text
    for replica in replicas:
        replica.wait_idle()
    deadline = time.monotonic() + 10
    while True:  # the router releases a request just after relaying its answer
        body = httpx.get(router.url + "/dashboard/api/fleet", headers=ADMIN).json()
        if body["totals"]["in_flight"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    rows = {row["name"]: row for row in body["replicas"]}
    assert set(rows) == {"r0", "r1"}
    assert body["totals"]["num_routed"] == sum(row["num_routed"] for row in rows.values()) == len(prompts)
    assert sum(row["routed_share"] for row in rows.values()) == pytest.approx(1.0)
    for name, replica in zip(("r0", "r1"), replicas):
        row = rows[name]
        assert row["healthy"] and row["in_flight"] == 0
        assert httpx.get(replica.url + "/metrics").status_code == 401  # read with the router's admin key
        queried, hit = replica_hits(replica.url)
        assert (row["prompt_tokens"], row["hit_tokens"]) == (queried, hit)
    totals = body["totals"]
    assert (totals["num_replicas"], totals["num_healthy"]) == (2, 2)
    assert totals["hit_tokens"] > 0  # the shared 48-token prefix was reused
    assert totals["hit_rate"] == pytest.approx(totals["hit_tokens"] / totals["prompt_tokens"])


def test_the_fleet_page_needs_no_key_and_its_data_needs_the_router_admin_key(fleet):
    router, _ = fleet
    page = httpx.get(router.url + "/dashboard")
    assert page.status_code == 200 and 'data-mode="fleet"' in page.text
    assert httpx.get(router.url + "/dashboard/static/fleet.js").status_code == 200
    assert httpx.get(router.url + "/dashboard/static/index.html").status_code == 404
    assert_openai_error(httpx.get(router.url + "/dashboard/api/fleet"), 401, code="invalid_api_key")
    assert_openai_error(
        httpx.get(router.url + "/dashboard/api/fleet", headers={"Authorization": "Bearer nope"}),
        401,
        code="invalid_api_key",
    )  # an unknown key; a tenant's key would be 403 admin_only


def test_a_router_without_an_admin_key_has_its_fleet_data_off(fleet):
    _, replicas = fleet
    with LiveRouter([replicas[0].url], None) as router:
        assert_openai_error(httpx.get(router.url + "/dashboard/api/fleet", headers=ADMIN), 404, code="admin_disabled")
