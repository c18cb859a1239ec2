"""Per-request cache_ttl (capped, with per-tenant defaults) and the measured reuse gaps in /v1/cache/stats."""

import json

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

ADMIN = "admin-secret"
KEYS = {"key-acme": {"tenant": "acme", "cache_ttl": 120}, "key-beta": "beta"}
PROMPT = "the shared system prompt of this test, long enough to fill a few blocks of sixteen tokens " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with LiveServer("--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--max-cache-ttl", "600") as live:
        yield live


def complete(server, key, **body):
    return httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body},
        timeout=60,
    )


def ttls_of_cached_blocks(server) -> set:
    import asyncio

    return asyncio.run(server.engine.call(lambda core: {block.ttl for block in core.cache._index.values()}))


def test_a_request_ttl_is_capped_by_the_server_maximum(server):
    assert complete(server, "key-beta", cache_ttl=5000, prompt=PROMPT + " beta").status_code == 200
    server.wait_idle()
    assert 600.0 in ttls_of_cached_blocks(server)


def test_a_tenant_without_a_ttl_in_its_request_gets_its_keys_file_default(server):
    assert complete(server, "key-acme", prompt=PROMPT + " acme").status_code == 200
    server.wait_idle()
    assert 120.0 in ttls_of_cached_blocks(server)


def test_prompt_cache_retention_24h_needs_a_server_that_keeps_a_day(server, tmp_path):
    refused = complete(server, "key-beta", prompt_cache_retention="24h")  # this server caps TTLs at 600 s
    assert_openai_error(refused, 400, "prompt_cache_retention")
    assert "--max-cache-ttl" in refused.json()["error"]["message"]
    both = complete(server, "key-beta", prompt_cache_retention="24h", cache_ttl=60)
    assert_openai_error(both, 400, "prompt_cache_retention")
    assert complete(server, "key-beta", prompt_cache_retention="in_memory", prompt_cache_key="s1").status_code == 200
    assert_openai_error(complete(server, "key-beta", prompt_cache_retention="1h"), 422, "prompt_cache_retention")
    with LiveServer("--max-cache-ttl", "86400") as day:
        response = httpx.post(
            day.url + "/v1/completions",
            timeout=60,
            json={"prompt": PROMPT, "max_tokens": 2, "prompt_cache_retention": "24h"},
        )
        assert response.status_code == 200, response.text
        day.wait_idle()
        assert ttls_of_cached_blocks(day) == {86400.0}


@pytest.mark.parametrize("value", [0, -1, "60", True, None])
def test_bad_cache_ttl_values_are_422_naming_the_field(server, value):
    if value is None:
        response = httpx.post(
            server.url + "/v1/completions",
            headers={"Authorization": "Bearer key-beta"},
            content=b'{"prompt": "x", "max_tokens": 1, "cache_ttl": NaN}',
            timeout=30,
        )
        assert response.status_code in (400, 422), response.text
        assert "Traceback" not in response.text
        return
    assert_openai_error(complete(server, "key-beta", cache_ttl=value), 422, param="cache_ttl")


def test_reuse_gaps_are_measured_per_tenant_and_exposed_to_the_operator_only(server):
    for _ in range(2):  # the second request returns to the prefix the first one released
        assert complete(server, "key-acme", prompt=PROMPT + " gaps").status_code == 200
        server.wait_idle()
    response = httpx.get(server.url + "/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert response.status_code == 200
    stats = response.json()
    gaps = stats["reuse_gaps"]
    assert gaps["by_tenant"]["acme"]["count"] >= 1
    assert len(gaps["overall"]["counts"]) == len(gaps["bucket_upper_bounds"]) + 1
    assert stats["max_cache_ttl"] == 600.0
    assert stats["mean_reused_prefix_tokens"] > 0
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    assert "prefixserve:prefix_reuse_gap_seconds_count " in metrics and "prefixserve:prefix_releases_total " in metrics
    # The reuse-gap histograms are per tenant only in /v1/cache/stats; /metrics (the operator's keys alone read
    # it where tenants have keys) carries each tenant's cache counters and holdings, never its gaps.
    assert 'prefix_reuse_gap_seconds_count{tenant="acme"}' not in metrics
    assert 'prefixserve:tenant_prefix_cache_requests_total{tenant="acme"}' in metrics


def test_cache_stats_refuses_tenants_and_missing_keys(server):
    assert_openai_error(httpx.get(server.url + "/v1/cache/stats", timeout=30), 401)
    assert_openai_error(
        httpx.get(server.url + "/v1/cache/stats", headers={"Authorization": "Bearer key-acme"}, timeout=30),
        403,
        code="admin_only",
    )


def test_cache_stats_is_off_without_an_admin_key():
    with LiveServer() as live:
        assert_openai_error(httpx.get(live.url + "/v1/cache/stats", timeout=30), 404, code="admin_disabled")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"tenant": "a", "cache_ttl": -5}, "cache_ttl"),
        ({"tenant": "a", "ttl": 5}, "fields"),
        ({"cache_ttl": 5}, "tenant"),
    ],
)
def test_a_bad_keys_file_entry_is_refused_at_start_up_naming_the_fix(tmp_path, entry, message):
    from prefixserve.http_keys import load_tenant_cache_ttls

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k": entry}))
    with pytest.raises(SystemExit, match=message):
        load_tenant_cache_ttls(str(keys))
