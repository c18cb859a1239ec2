"""Tenants' shares through the server (issue: many tenants on one cache): the keys file sets them; one tenant's
cache_control pins stop at its pin_share, another's pinned prefix survives its flood, the operator's pin
succeeds and tenant pins give way to it at the cap; /v1/cache/stats and /metrics show each tenant's holdings."""

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer

from prefixserve.metric_names import TENANT_KV_BLOCKS

KEYS = {
    "key-a": {"tenant": "tenant-a", "min_kv_share": 0.25},
    "key-b": "tenant-b",  # the server-wide defaults: a quarter of the pin cap, no minimum
}
ADMIN, METRICS = "ops-admin-key", "scraper-key"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def text_of(seed: int, num_words: int) -> str:
    """A distinct prompt text per seed (no two share a block)."""
    return " ".join(f"{WORDS[(seed * 7 + i) % len(WORDS)]}{seed}" for i in range(num_words))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("shares") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # 16 MiB: a 64-block pool, a pin cap of 32 blocks: each tenant's pins at most 8 by default.
    options = ("--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--metrics-api-key", METRICS)
    with LiveServer(*options, "--kv-cache-memory-bytes", str(16 << 20)) as live:
        yield live


def message(server, key, system, user="Say hi.", ttl="1h"):
    body = {"model": "prefixserve-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": user}]}
    if system is not None:
        body["system"] = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": ttl}}]
    response = httpx.post(server.url + "/v1/messages", headers={"x-api-key": key}, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def stats(server):
    response = httpx.get(server.url + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_one_tenants_pins_stop_at_its_share_and_anothers_pinned_prefix_survives_its_flood(server):
    for seed in range(8):  # B's 8 cache_control breakpoints of ~6 blocks each, for an hour
        message(server, "key-b", text_of(seed, 20))
    b_pins = stats(server)["tenants"]["tenant-b"]["pins"]
    assert b_pins["limit"] == 8 and 0 < b_pins["pinned"] <= 8  # one fitted; the rest stopped at B's share

    a_system = text_of(100, 20)
    first = message(server, "key-a", a_system)
    assert first["cache_creation_input_tokens"] > 0
    assert stats(server)["tenants"]["tenant-a"]["pins"]["pinned"] > 0  # A's breakpoint pinned: room was left
    for seed in range(200, 240):  # 40 one-off prompts from B, each longer than A's whole prefix
        message(server, "key-b", None, user=text_of(seed, 120))
    again = message(server, "key-a", a_system)
    assert again["cache_read_input_tokens"] >= first["cache_creation_input_tokens"]

    pin = httpx.post(
        server.url + "/v1/cache/pin",
        headers={"Authorization": f"Bearer {ADMIN}"},
        json={"prompt": text_of(300, 60)},
        timeout=60,
    )
    assert pin.status_code == 200, pin.text  # the operator's pin claims no tenant's share
    report = stats(server)
    assert report["tenants"]["tenant-b"]["pins"]["pinned"] <= 8
    assert report["tenants"]["tenant-a"]["pool"]["min"] == 16  # a quarter of 64 blocks
    assert report["shares"]["tenants"]["tenant-a"]["min_kv_share"] == 0.25
    assert report["tenants"]["tenant-b"]["counters"]["queries"] == 48


def test_per_tenant_counters_and_holdings_are_on_metrics_for_the_operator(server):
    message(server, "key-a", text_of(400, 20))
    response = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {METRICS}"}, timeout=30)
    assert response.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    assert samples[("prefixserve:tenant_prefix_cache_requests_total", (("tenant", "tenant-a"),))] >= 1
    assert samples[(TENANT_KV_BLOCKS, (("state", "held"), ("tenant", "tenant-a")))] > 0
    assert samples[(TENANT_KV_BLOCKS, (("state", "pin_limit"), ("tenant", "tenant-b")))] == 8
    anonymous = httpx.get(server.url + "/metrics", timeout=30)
    assert anonymous.status_code == 401  # no unauthenticated request learns a tenant's token counts
    tenant = httpx.get(server.url + "/metrics", headers={"x-api-key": "key-a"}, timeout=30)
    assert tenant.status_code == 403


def test_tenant_pins_give_way_to_the_operators_at_the_cap(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": {"tenant": "tenant-a", "pin_share": 1.0}}))
    options = ("--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--hot-prefix-min-requests", "0")
    with LiveServer(*options, "--kv-cache-memory-bytes", str(16 << 20), "--max-pinned-blocks", "12") as live:
        for seed in range(2):  # A's two breakpoints of ~6 blocks: the whole cap of 12
            message(live, "key-a", text_of(500 + seed, 20))
        assert stats(live)["tenants"]["tenant-a"]["pins"]["pinned"] > 6
        pins = httpx.get(live.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        before = {pin["id"]: pin for pin in pins.json()["data"]}
        assert {pin["kind"] for pin in before.values()} == {"retention"}
        pin = httpx.post(
            live.url + "/v1/cache/pin",
            headers={"Authorization": f"Bearer {ADMIN}"},
            json={"prompt": text_of(600, 30)},
            timeout=60,
        )
        assert pin.status_code == 200, pin.text
        after = httpx.get(live.url + "/v1/cache/pins", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        kept = {p["id"] for p in after.json()["data"]}
        oldest = min(before.values(), key=lambda p: p["created_at"])
        assert oldest["id"] not in kept  # the oldest retention pin gave way, the operator's holds
        assert pin.json()["id"] in kept


def test_the_dashboard_shows_each_tenants_shares(server):
    message(server, "key-a", text_of(700, 20))
    response = httpx.get(
        server.url + "/dashboard/api/snapshot", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    rows = {row["tenant"]: row for row in response.json()["tenants"]}
    assert rows["tenant-a"]["kv_share"]["min"] == 16 and rows["tenant-a"]["kv_share"]["held"] > 0
    assert rows["tenant-b"]["pins"]["limit"] == 8
