"""The dashboard in a real browser (Debian's chromium via Playwright) against live servers under traffic.

Every wait is for a condition on the page (a count of drawn snapshots, an element, a changed value),
bounded by Playwright's timeout; traffic loops are bounded too. The docs' screenshots come from here:
PREFIXSERVE_SCREENSHOTS=docs/screenshots python -m pytest tests/test_dashboard_browser.py
"""

import json
import random
from dataclasses import asdict

import httpx
import pytest
from browser_helpers import (
    LiveRouter,
    Traffic,
    browser_page,
    enter_admin_key,
    metrics_samples,
    save_screenshot,
    wait_for_updates,
)
from server_helpers import LiveServer

from prefixserve.cache import BlockKeyer, RadixCache
from prefixserve.cache.scoping import compose_salt
from prefixserve.cache.tree_view import build_tree_view

ADMIN_KEY = "dash-browser-admin"
TENANT_KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
SHARED = list(range(400, 400 + 64))  # 4 full blocks every prompt of the traffic starts with


def prompt(i: int) -> dict:
    """Shared prefix, then a tail that differs per request (1 to 3 blocks), so the tree forks after it."""
    return {"model": "prefixserve-tiny", "prompt": SHARED + [5000 + i] * (16 * (1 + i % 3)) + [7], "max_tokens": 2}


def fleet_prompt(i: int) -> dict:
    """Two prefix families, so kv_aware routing keeps each on a replica of its own."""
    body = prompt(i)
    body["prompt"] = [p + 1000 * (i % 2) for p in body["prompt"]]
    return body


def tenant_header(i: int) -> dict:
    return {"Authorization": "Bearer " + ("key-a" if i % 2 else "key-b")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    with LiveServer("--admin-api-key", ADMIN_KEY, "--api-keys-file", str(keys)) as live:
        yield live


def shared_key_label(server, tenant: str) -> str:
    core = server.engine.engine
    return core.keyer.keys(core.scope.with_salt(compose_salt(tenant, None)).digest, SHARED)[0].hex()[:12]


def mismatches_with_metrics(page, url: str, attempts: int = 5) -> list:
    """The page's totals that differ from /metrics, once they agree or after `attempts` redraws.

    Idle, nothing changes them; but a background task (hot-prefix pinning) may move a gauge between
    the page's snapshot and our read of /metrics, so a disagreement gets another redraw to settle.
    """
    for _ in range(attempts):
        expected = metrics_samples(url, ADMIN_KEY)
        shown = page.eval_on_selector_all(
            "#totals td[data-metric]", "cells => cells.map(c => [c.dataset.metric, c.textContent])"
        )
        assert len(shown) >= 20
        mismatches = [
            (metric, text, expected.get(metric))
            for metric, text in shown
            if metric not in expected or float(text) != expected[metric]
        ]
        if not mismatches:
            return []
        wait_for_updates(page, 1)
    return mismatches


def test_the_page_shows_metrics_equal_to_prometheus_and_the_shared_prefix_under_traffic(server):
    with browser_page() as page:
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#notice:not([hidden])")  # no key yet: the page asks for one
        assert "admin key" in page.inner_text("#notice")
        enter_admin_key(page, ADMIN_KEY)
        with Traffic(server.url, prompt, tenant_header, max_requests=400) as traffic:
            page.wait_for_function("document.querySelectorAll('#tree rect.prefix').length >= 3")
            wait_for_updates(page, 8)  # some seconds of charts for the screenshot
            save_screenshot(page, "dashboard.png")
        assert traffic.num_sent > 0 and not traffic.failures
        server.wait_idle()
        wait_for_updates(page, 2, tree=True)  # a snapshot taken after the traffic stopped, tree included

        assert mismatches_with_metrics(page, server.url) == []
        assert page.inner_text("#card-queue") == "0 · 0"
        tenants = page.eval_on_selector_all("#tenants tbody tr", "rows => rows.map(r => r.dataset.tenant)")
        assert sorted(tenants) == ["tenant-a", "tenant-b"]
        assert "prompt" not in page.inner_text("#tenants").lower().replace("prompt tokens", "")

        for tenant in ("tenant-a", "tenant-b"):  # each tenant's copy of the shared prefix is one 64-token bar
            rect = page.wait_for_selector(f'#tree rect[data-key="{shared_key_label(server, tenant)}"]')
            assert rect.get_attribute("data-tokens") == str(len(SHARED))
            assert int(rect.get_attribute("data-subtree-blocks")) > len(SHARED) // 16
        page.hover(f'#tree rect[data-key="{shared_key_label(server, "tenant-a")}"]')
        assert "64 tokens" in page.inner_text("#tree-detail")
        save_screenshot(page, "dashboard-tree.png", "#tree-wrap")
        assert page.js_errors == []


def test_the_price_sliders_change_the_what_if_outputs(server):
    for i in range(4):  # something measured, so every panel has data
        assert (
            httpx.post(
                server.url + "/v1/completions", json=prompt(i), headers=tenant_header(i), timeout=120
            ).status_code
            == 200
        )
    server.wait_idle()
    with browser_page() as page:
        page.goto(server.url + "/dashboard")
        enter_admin_key(page, ADMIN_KEY)
        page.wait_for_selector('#price-body[data-state="ready"] tr[data-vendor]')
        first = "#price-body tr[data-vendor] td[data-field='usd_per_request']"
        assert "as of" in page.inner_text("#price-body tr[data-vendor] td[data-field='source']")

        def changes_to(selector: str, value: str) -> str:
            before = page.inner_text(first)
            page.fill(selector, value)
            page.wait_for_function(
                "([cell, before]) => document.querySelector(cell).textContent !== before", arg=[first, before]
            )
            return page.inner_text(first)

        none_cached = changes_to("#price-hit-rate", "0")
        assert page.inner_text("#price-hit-rate-value") == "0.0%"
        all_cached = changes_to("#price-hit-rate", "1")
        assert page.inner_text("#price-hit-rate-value") == "100.0%"
        assert none_cached != all_cached
        longer = changes_to("#price-prompt-tokens", "65536")
        assert longer != all_cached
        assert "65,536" in page.inner_text("#price-ttft")
        page.wait_for_selector('#tiers-body[data-state="ready"] svg polyline')
        page.wait_for_selector('#capacity-body[data-state="ready"] tr[data-pool-blocks]')
        page.wait_for_selector('#ttl-body[data-state="ready"]')
        save_screenshot(page, "dashboard-whatif.png", ".whatif-grid")
        assert page.js_errors == []


def big_tree(num_blocks: int = 100_000) -> dict:
    """The snapshot tree of a pool holding `num_blocks` cached blocks: 4 system prompts, random tails."""
    size = 16
    cache, keyer = RadixCache(num_blocks + 500, size), BlockKeyer(size)
    rng = random.Random(0)
    while cache.num_cached_blocks < num_blocks:
        tokens = [rng.randrange(4)] * (size * 32) + [rng.randrange(8000) for _ in range(size * rng.randrange(1, 40))]
        keys = keyer.keys(b"s" * 32, tokens)
        parent = b"s" * 32
        for i, key in enumerate(keys):
            block = cache.get(key)
            if block is None:
                block = cache.insert(cache.allocate(1)[0], key, tokens[i * size : (i + 1) * size], parent)
                cache.release([block])
            parent = block
    tree = asdict(build_tree_view(map(cache.get, cache.keys()), size))
    tree["max_nodes"] = 300
    return tree


def test_a_pool_of_100000_blocks_draws_at_most_300_bars(server):
    """The page against the largest tree the server sends (the snapshot intercepted, its tree replaced)."""
    with browser_page() as page:  # first: it skips the test when there is no browser
        snapshot = httpx.get(
            server.url + "/dashboard/api/snapshot", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()
        snapshot["tree"] = big_tree()
        assert snapshot["tree"]["num_blocks"] >= 100_000
        page.route(
            "**/dashboard/api/snapshot*",
            lambda route: route.fulfill(status=200, content_type="application/json", body=json.dumps(snapshot)),
        )
        page.goto(server.url + "/dashboard")
        enter_admin_key(page, ADMIN_KEY)
        wait_for_updates(page, 2, tree=True)
        num_bars = page.eval_on_selector_all("#tree rect", "rects => rects.length")
        assert 100 <= num_bars <= 300
        assert page.eval_on_selector_all("#tree rect.more", "rects => rects.length") >= 1
        assert "100,0" in page.inner_text("#tree-summary")
        save_screenshot(page, "dashboard-tree-100k.png", "#tree-wrap")
        assert page.js_errors == []


def test_the_page_says_how_to_turn_the_data_on_and_refuses_a_tenant_key(server):
    with LiveServer() as plain, browser_page() as page:
        page.goto(plain.url + "/dashboard")
        page.wait_for_selector("#notice:not([hidden])")
        assert "--admin-api-key" in page.inner_text("#notice")
    with browser_page() as page:
        page.goto(server.url + "/dashboard")
        enter_admin_key(page, "key-a")
        page.wait_for_function("document.querySelector('#notice').textContent.includes('refused')")
        assert "not a tenant" in page.inner_text("#notice")


def test_the_router_page_has_one_row_per_replica_and_the_fleet_totals():
    args = ("--admin-api-key", ADMIN_KEY, "--enable-kv-events")
    with (
        LiveServer(*args) as first,
        LiveServer(*args) as second,
        LiveRouter([first.url, second.url], ADMIN_KEY) as router,
        browser_page() as page,
    ):
        page.goto(router.url + "/dashboard")
        enter_admin_key(page, ADMIN_KEY)
        page.wait_for_selector('#replicas tbody tr[data-replica="r1"]')
        with Traffic(router.url, fleet_prompt, max_requests=12) as traffic:
            wait_for_updates(page, 2)
        for replica in (first, second):
            replica.wait_idle()
        fleet = httpx.get(router.url + "/dashboard/api/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        # the traffic stops once the page has updated twice: on a loaded machine before all 12 were sent
        assert fleet["totals"]["num_routed"] == traffic.num_sent > 0
        page.wait_for_function(f"document.querySelector('#fleet-routed').textContent === '{traffic.num_sent}'")
        wait_for_updates(page, 1)
        for row in fleet["replicas"]:
            cells = f'#replicas tbody tr[data-replica="{row["name"]}"]'
            assert page.inner_text(cells + ' td[data-field="health"]') == "healthy"
            assert page.inner_text(cells + ' td[data-field="num_routed"]') == str(row["num_routed"])
        assert page.inner_text("#fleet-healthy") == "2 / 2"
        save_screenshot(page, "dashboard-fleet.png")
        assert page.js_errors == []
