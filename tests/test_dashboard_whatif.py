"""The dashboard's what-if endpoints (server/dashboard/whatif.py): admin key only, 400s that name the parameter,
exact answers over a fake engine core with given costs, and the whole path on a real server."""

import math
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram
from server_helpers import LiveServer, assert_openai_error
from test_plan_capacity import chain

from prefixserve.cache import RadixCache
from prefixserve.cache.reuse_gaps import ReuseGapTracker
from prefixserve.engine.request_log import RequestLog, RequestLogEntry
from prefixserve.engine.tier_context import DEFAULT_PREFILL_SECONDS_PER_TOKEN
from prefixserve.plan.price import VENDOR_PRICES
from prefixserve.server.api import admin_router
from prefixserve.server.auth import Authenticator
from prefixserve.server.errors import install_error_handlers
from prefixserve.tiers import TierCost

ADMIN = {"Authorization": "Bearer admin-key"}
BLOCK_SIZE = 4
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 1 * 8 * 4  # (layers, K/V, block, kv heads, head dim) float32: 128 bytes a token


class FakeEngine:
    """AsyncLLMEngine.call on a core we build: the endpoint's function runs as it would between steps."""

    def __init__(self, core) -> None:
        self.core = core

    async def call(self, function):
        return function(self.core)


def fake_tiers(prefill_seconds_per_token=DEFAULT_PREFILL_SECONDS_PER_TOKEN, tiers=None):
    """What the what-if panel reads of an engine's TieredKV: its tiers (none: an empty one), the learnt prefill
    and a block's bytes."""
    context = SimpleNamespace(prefill_seconds_per_token=prefill_seconds_per_token, block_bytes=BLOCK_BYTES)
    return SimpleNamespace(tiers=tiers or {}, context=context)


def make_core(tiers=None):
    tiers = fake_tiers() if tiers is None else tiers
    return SimpleNamespace(
        config=SimpleNamespace(block_size=BLOCK_SIZE),
        cache=RadixCache(6, BLOCK_SIZE),
        runner=SimpleNamespace(block_shape=(2, 2, BLOCK_SIZE, 1, 8), dtype_name="float32"),
        tiers=tiers,
        reuse_gaps=ReuseGapTracker(BLOCK_SIZE),
        outputs=SimpleNamespace(request_log=RequestLog()),
    )


def make_client(core, admin_api_key="admin-key"):
    registry = CollectorRegistry()
    ttft = Histogram("prefixserve:time_to_first_token_seconds", "TTFT", registry=registry)
    app = FastAPI()
    install_error_handlers(app)
    app.state.server = SimpleNamespace(
        auth=Authenticator({"tenant-key": "acme"}, admin_api_key),
        engine=FakeEngine(core),
        metrics=SimpleNamespace(registry=registry, ttft=ttft),
    )
    app.include_router(admin_router())  # the one way admin routes are mounted: under the guard
    return TestClient(app), ttft


PATHS = ("/dashboard/api/price", "/dashboard/api/tiers", "/dashboard/api/ttl", "/dashboard/api/capacity")


def test_every_endpoint_answers_the_admin_key_only():
    client, _ = make_client(make_core())
    for path in PATHS:
        assert_openai_error(client.get(path), 401, code="invalid_api_key")
        assert_openai_error(client.get(path, headers={"Authorization": "Bearer tenant-key"}), 403, code="admin_only")
        assert client.get(path, headers=ADMIN).status_code == 200
    off, _ = make_client(make_core(), admin_api_key=None)
    for path in PATHS:
        assert_openai_error(off.get(path, headers=ADMIN), 404, code="admin_disabled")


@pytest.mark.parametrize(
    "path, query, param",
    [
        ("/dashboard/api/price", "hit_rate=1.5", "hit_rate"),
        ("/dashboard/api/price", "hit_rate=abc", "hit_rate"),
        ("/dashboard/api/price", "prompt_tokens=0", "prompt_tokens"),
        ("/dashboard/api/price", "prompt_tokens=inf", "prompt_tokens"),
        ("/dashboard/api/tiers", "max_tokens=-3", "max_tokens"),
        ("/dashboard/api/ttl", "ttls=10,-1", "ttls"),
        ("/dashboard/api/ttl", "tenant=nobody", "tenant"),
        ("/dashboard/api/capacity", "sizes=4,x", "sizes"),
        ("/dashboard/api/capacity", "sizes=0", "sizes"),
        ("/dashboard/api/capacity", "sizes=" + ",".join(["4"] * 17), "sizes"),
        ("/dashboard/api/capacity", "trace=/etc/passwd", "trace"),
        ("/dashboard/api/capacity", "trace=agent&limit=0", "limit"),
    ],
)
def test_bad_query_values_are_400s_naming_the_parameter(path, query, param):
    client, _ = make_client(make_core())
    response = client.get(f"{path}?{query}", headers=ADMIN)
    assert_openai_error(response, 400, param=param, code="invalid_value")
    assert param in response.json()["error"]["message"]


def test_price_defaults_to_the_measured_hit_rate_and_prompt_length():
    core = make_core()
    client, ttft = make_client(core)
    body = client.get("/dashboard/api/price", headers=ADMIN).json()  # nothing measured yet
    assert (body["hit_rate"], body["prompt_tokens"], body["measured"]["hit_rate"]) == (0.0, 2000, None)
    assert body["sources"]["hit_rate"].startswith("default")
    core.cache.stats.record_query(1000, 750)
    core.cache.stats.record_query(1000, 750)
    ttft.observe(0.5)
    body = client.get("/dashboard/api/price", headers=ADMIN).json()
    assert (body["hit_rate"], body["prompt_tokens"]) == (0.75, 1000)
    assert body["measured"]["mean_ttft_seconds"] == 0.5 and body["sources"]["hit_rate"] == "measured"
    assert [row["vendor"] for row in body["vendors"]] == [entry.name for entry in VENDOR_PRICES]
    deepseek = body["vendors"][0]
    assert deepseek["usd_per_million_input_tokens"] == pytest.approx(0.75 * 0.07 + 0.25 * 0.27)
    assert deepseek["source"].startswith("https://") and deepseek["as_of"]
    # No tiers: the default prefill (2e-4 s a token); the fixed part reproduces the measured mean at 75%.
    assert body["ttft"]["fixed_seconds"] == pytest.approx(0.5 - 250 * 2e-4)
    assert body["ttft"]["seconds"] == pytest.approx(0.5)
    given = client.get("/dashboard/api/price?hit_rate=0&prompt_tokens=2000", headers=ADMIN).json()
    assert given["sources"]["hit_rate"] == "query"
    assert given["ttft"]["seconds"] == pytest.approx(0.45 + 2000 * 2e-4)


def test_tiers_curves_and_crossover_from_the_engines_costs():
    prefill = 2.0**-9
    host, disk = TierCost(0.0, 2.0**20), TierCost(1e-3, 2.0**16)
    tiers = fake_tiers(prefill, {"host": SimpleNamespace(read_cost=host), "disk": SimpleNamespace(read_cost=disk)})
    client, _ = make_client(make_core(tiers))
    body = client.get("/dashboard/api/tiers?max_tokens=64", headers=ADMIN).json()
    assert body["bytes_per_token"] == 128 and body["prefill_seconds_per_token"] == prefill
    assert body["sources"]["prefill_seconds_per_token"].startswith("measured")
    assert body["prefix_tokens"] == list(range(4, 65, 4))
    assert body["recompute_seconds"][-1] == 64 * prefill
    by_tier = {row["tier"]: row for row in body["tiers"]}
    assert by_tier["host"]["crossover_tokens"] == 0.0  # no latency, cheaper per token: fetch always wins
    assert by_tier["host"]["fetch_seconds"][0] == 4 * 128 / 2.0**20
    # disk: 128 B at 2**16 B/s = 2**-9 s a token, exactly the prefill: a fetch never wins.
    assert by_tier["disk"]["crossover_tokens"] is None and by_tier["disk"]["crossover_blocks"] is None
    default = make_client(make_core())[0].get("/dashboard/api/tiers", headers=ADMIN).json()
    assert {row["tier"] for row in default["tiers"]} == {"host", "disk"}
    assert default["sources"]["read_costs"].startswith("the tiers' start-up priors")
    assert default["prefix_tokens"][-1] <= 1_000_000 and len(default["prefix_tokens"]) <= 48


def test_ttl_from_the_measured_reuse_gaps():
    core = make_core()
    client, _ = make_client(core)
    body = client.get("/dashboard/api/ttl", headers=ADMIN).json()
    assert body["available"] is False and "released" in body["reason"]
    # The tracker's snapshot() shape (GET /v1/cache/stats' reuse_gaps): 3 releases, each back 20 s later.
    bounds = [0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400]

    def histogram(count):
        counts = [0] * (len(bounds) + 1)
        counts[bounds.index(30)] = count  # the (10, 30] bucket
        return {"counts": counts, "count": count, "sum": 20.0 * count, "num_releases": count}

    def snapshot():
        return {
            "bucket_upper_bounds": bounds,
            "overall": histogram(3),
            "by_tenant": {"acme": histogram(2), "beta": histogram(1)},
        }

    core.reuse_gaps = SimpleNamespace(
        mean_reused_prefix_tokens=640.0,
        snapshot=snapshot,
        stats_body=lambda: {"reuse_gaps": snapshot(), "mean_reused_prefix_tokens": 640.0},
    )
    body = client.get("/dashboard/api/ttl?ttls=10,30,60&prefix_tokens=1000", headers=ADMIN).json()
    assert body["available"] is True and body["num_releases"] == 3 and body["return_fraction"] == 1.0
    rows = {row["ttl_seconds"]: row for row in body["rows"]}
    assert rows[30.0]["survival"] == 1.0 and rows[60.0]["survival"] == 1.0
    assert rows[10.0]["survival"] == 0.0  # all gaps fall in the (10, 30] bucket
    assert rows[10.0]["extra_ttft_seconds_per_turn"] == pytest.approx(1000 * 2e-4)
    assert body["recommended"]["ttl_seconds"] == 30.0
    assert body["sources"]["releases_per_second"].startswith("stated")  # the request log is empty
    measured = client.get("/dashboard/api/ttl?ttls=30", headers=ADMIN).json()
    assert measured["prefix_tokens"] == 640.0 and measured["sources"]["prefix_tokens"].startswith("measured")
    tenant = client.get("/dashboard/api/ttl?tenant=beta&ttls=30", headers=ADMIN).json()
    assert tenant["tenant"] == "beta" and tenant["num_releases"] == 1


def test_capacity_replays_the_request_log_at_each_size():
    core = make_core()
    client, _ = make_client(core)
    assert client.get("/dashboard/api/capacity", headers=ADMIN).json()["available"] is False
    log = core.outputs.request_log
    for i, name in enumerate(["A", "B", "C"] * 3):  # as tests/test_plan_capacity.py's cycling log
        log._entries[str(i)] = RequestLogEntry(float(i), None, chain(name), 5, finished=True)
    body = client.get("/dashboard/api/capacity?sizes=3,4,1000000", headers=ADMIN).json()
    assert body["available"] and body["num_requests"] == 9 and body["working_set_blocks"] == 3
    assert body["current_pool_blocks"] == 6
    rows = {row["pool_blocks"]: row for row in body["sizes"]}
    assert (rows[3]["hit_rate"], rows[3]["num_evicted_blocks"], rows[3]["num_capacity_miss_tokens"]) == (0, 7, 24)
    assert rows[3]["capacity_miss_seconds"] == pytest.approx(24 * 2e-4)
    assert rows[4]["hit_rate"] == 24 / 45 and rows[4]["num_evicted_blocks"] == 0
    assert rows[1000000] == {**rows[4], "pool_blocks": 1000000, "pool_tokens": 4000000}  # never evicts either
    default = client.get("/dashboard/api/capacity", headers=ADMIN).json()
    assert [row["pool_blocks"] for row in default["sizes"]] == [1, 2, 3, 6, 12, 24]  # 1/8x .. 4x the pool of 6


def test_capacity_replays_a_built_in_trace_in_its_own_blocks():
    client, _ = make_client(make_core())
    body = client.get("/dashboard/api/capacity?trace=conversation&limit=300&sizes=40,5000", headers=ADMIN).json()
    assert body["block_size"] == 512 and body["num_requests"] == 300 and "conversation" in body["sources"]["requests"]
    small, large = body["sizes"]
    assert small["hit_rate"] < large["hit_rate"] and small["num_evicted_blocks"] > 0
    assert small["num_capacity_miss_tokens"] > large["num_capacity_miss_tokens"]


def test_the_endpoints_on_a_real_server():
    with LiveServer("--admin-api-key", "admin-key", "--block-size", "16") as server:
        prompt = list(range(1, 70))  # 4 full blocks and a tail
        for _ in range(3):
            response = httpx.post(
                server.url + "/v1/completions",
                json={"model": "prefixserve-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
                timeout=60,
            )
            assert response.status_code == 200, response.text
        server.wait_idle()
        capacity = httpx.get(server.url + "/dashboard/api/capacity?sizes=2,64", headers=ADMIN, timeout=60).json()
        assert capacity["num_requests"] == 3 and capacity["block_size"] == 16
        rows = {row["pool_blocks"]: row for row in capacity["sizes"]}
        assert rows[64]["num_hit_tokens"] == 2 * 64  # the 2nd and 3rd requests reuse the 4 full blocks
        assert rows[2]["num_oversized_requests"] == 3  # 5 blocks a request: more than a pool of 2
        price = httpx.get(server.url + "/dashboard/api/price", headers=ADMIN, timeout=60).json()
        assert price["prompt_tokens"] == 69 and price["hit_rate"] == pytest.approx(128 / 207)
        assert price["measured"]["mean_ttft_seconds"] > 0
        tiers = httpx.get(server.url + "/dashboard/api/tiers", headers=ADMIN, timeout=60).json()
        assert tiers["bytes_per_token"] == 2 * 8 * 4 * 64 * 4  # the built-in model's KV in float32
        ttl = httpx.get(server.url + "/dashboard/api/ttl", headers=ADMIN, timeout=60).json()
        assert ttl["available"] and ttl["num_releases"] == 3 and math.isclose(ttl["return_fraction"], 2 / 3)
