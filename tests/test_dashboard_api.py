"""The dashboard's page and JSON snapshot on a live server: admin key only, equal to /metrics, no token text."""

import json

import httpx
import pytest
from browser_helpers import metrics_samples
from server_helpers import LiveServer, assert_openai_error

from prefixserve.cache.scoping import compose_salt
from prefixserve.server.dashboard.snapshot import histogram_quantile

ADMIN = {"Authorization": "Bearer dash-admin"}
SHARED = list(range(300, 300 + 64))  # 4 full blocks every prompt starts with
SECRET_WORD = "zebracornflakes"


def complete(url: str, prompt, key: str = "") -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(
        url + "/v1/completions",
        json={"model": "prefixserve-tiny", "prompt": prompt, "max_tokens": 2},
        headers=headers,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    with LiveServer("--admin-api-key", "dash-admin", "--api-keys-file", str(keys)) as live:
        yield live


def test_the_page_and_its_files_need_no_key_and_other_names_are_404(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-mode="server"' in page.text and "https://" not in page.text.split("<body")[0]  # no CDN
    for name, media in (
        ("dashboard.js", "text/javascript"),
        ("tree.js", "text/javascript"),
        ("dashboard.css", "text/css"),
    ):
        response = httpx.get(server.url + "/dashboard/static/" + name)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media), name
    for name in ("index.html", "..%2Frecorder.py", "nope.js"):
        assert httpx.get(server.url + "/dashboard/static/" + name).status_code == 404


def test_the_snapshot_answers_the_admin_key_only(server):
    assert_openai_error(httpx.get(server.url + "/dashboard/api/snapshot"), 401, code="invalid_api_key")
    assert_openai_error(
        httpx.get(server.url + "/dashboard/api/snapshot", headers={"Authorization": "Bearer key-a"}),
        403,
        code="admin_only",
    )
    assert httpx.get(server.url + "/dashboard/api/snapshot", headers=ADMIN).status_code == 200


def test_without_an_admin_key_configured_the_snapshot_is_off():
    with LiveServer() as live:
        assert httpx.get(live.url + "/dashboard").status_code == 200
        assert_openai_error(httpx.get(live.url + "/dashboard/api/snapshot", headers=ADMIN), 404, code="admin_disabled")


def test_counters_equal_metrics_and_tenants_and_ttft_split_add_up(server):
    usages = {"tenant-a": [], "tenant-b": []}
    for i in range(3):
        usages["tenant-a"].append(complete(server.url, SHARED + [1000 + i] * 20, "key-a"))
    usages["tenant-b"].append(complete(server.url, SHARED + [2000] * 20, "key-b"))
    server.wait_idle()
    snapshot = httpx.get(server.url + "/dashboard/api/snapshot", headers=ADMIN).json()
    metrics = metrics_samples(server.url, "dash-admin")
    assert snapshot["metrics"] == {key: metrics[key] for key in snapshot["metrics"]}
    assert "prefixserve:prefix_cache_hits_total" in snapshot["metrics"]
    assert 'prefixserve:kv_blocks{state="free"}' in snapshot["metrics"]
    tenants = {row["tenant"]: row for row in snapshot["tenants"]}
    for tenant, usage in usages.items():
        prompt = sum(u["prompt_tokens"] for u in usage)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
        row = tenants[tenant]
        assert (row["num_requests"], row["prompt_tokens"], row["cached_tokens"]) >= (len(usage), prompt, cached)
        assert row["blocks_held"] > 0
    assert tenants["tenant-b"]["cached_tokens"] == 0  # tenants never share a private prefix
    assert tenants["tenant-a"]["cached_tokens"] > 0
    ttft = snapshot["ttft"]
    assert (
        ttft["hit"]["count"] + ttft["miss"]["count"]
        == ttft["all"]["count"]
        == metrics["prefixserve:time_to_first_token_seconds_count"]
    )
    assert ttft["hit"]["count"] == metrics['prefixserve:time_to_first_token_by_cache_seconds_count{cache="hit"}'] >= 2
    assert ttft["hit"]["p50"] is not None and ttft["hit"]["p50"] <= ttft["hit"]["p99"]
    pool = snapshot["pool"]
    assert pool["num_blocks"] == metrics["prefixserve:kv_blocks_total"]
    assert 0.0 <= pool["pressure"] <= 1.0


def test_a_streamed_request_counts_for_the_tenant_of_its_key(server):
    def tenant_b_requests():
        snapshot = httpx.get(server.url + "/dashboard/api/snapshot?tree=false", headers=ADMIN).json()
        return next((row["num_requests"] for row in snapshot["tenants"] if row["tenant"] == "tenant-b"), 0)

    before = tenant_b_requests()
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": "Bearer key-b"},
        timeout=120,
        json={"model": "prefixserve-tiny", "prompt": [5, 6, 7] * 10, "max_tokens": 3, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert "[DONE]" in "".join(response.iter_text())
    server.wait_idle()
    assert tenant_b_requests() == before + 1


def test_an_x_api_key_request_counts_for_its_tenant_not_as_no_key(server):
    """Anthropic's API takes the key as x-api-key: the dashboard reads a request's tenant as its handler does."""

    def counts():
        snapshot = httpx.get(server.url + "/dashboard/api/snapshot?tree=false", headers=ADMIN).json()
        return {row["tenant"]: row["num_requests"] for row in snapshot["tenants"]}

    before = counts()
    body = {"model": "prefixserve-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "count me"}]}
    headers = {"x-api-key": "key-b", "anthropic-version": "2023-06-01"}
    assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=120).status_code == 200
    completion = {"model": "prefixserve-tiny", "prompt": "count me too", "max_tokens": 2}
    response = httpx.post(server.url + "/v1/completions", json=completion, headers={"x-api-key": "key-b"}, timeout=120)
    assert response.status_code == 200, response.text
    server.wait_idle()
    after = counts()
    assert after.get("tenant-b", 0) == before.get("tenant-b", 0) + 2
    assert after.get("(no key)", 0) == before.get("(no key)", 0)


def test_the_tree_shows_a_shared_prefix_and_never_tokens_or_text(server):
    complete(server.url, f"{SECRET_WORD} " * 40, "key-a")
    for i in range(2):
        complete(server.url, SHARED + [3000 + i] * 20, "key-b")
    server.wait_idle()
    body = httpx.get(server.url + "/dashboard/api/snapshot", headers=ADMIN)
    assert SECRET_WORD not in body.text and "token_ids" not in body.text
    tree = body.json()["tree"]
    core = server.engine.engine
    scope = core.scope.with_salt(compose_salt("tenant-b", None)).digest
    first_key = core.keyer.keys(scope, SHARED)[0].hex()[:12]
    shared = [n for n in tree["nodes"] if n["label"] == first_key]
    assert len(shared) == 1 and shared[0]["num_tokens"] == len(SHARED)
    assert sum(n["parent"] == shared[0]["id"] for n in tree["nodes"]) >= 2  # the prompts fork after it
    scope_node = next(n for n in tree["nodes"] if n["id"] == shared[0]["parent"])
    assert scope_node["label"] == "tenant-b"
    assert tree["blocks_by_scope"]["tenant-b"] == scope_node["subtree_blocks"]
    assert len(tree["nodes"]) <= tree["max_nodes"]
    small = httpx.get(server.url + "/dashboard/api/snapshot?max_nodes=2", headers=ADMIN).json()["tree"]
    assert len(small["nodes"]) <= 2
    assert_openai_error(
        httpx.get(server.url + "/dashboard/api/snapshot?max_nodes=1", headers=ADMIN), 422, param="max_nodes"
    )
    assert httpx.get(server.url + "/dashboard/api/snapshot?tree=false", headers=ADMIN).json()["tree"] is None


def test_histogram_quantile_interpolates_within_the_bucket_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.5, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * 9.8 / 10)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 4.0)]) == 0.1  # +Inf: the largest finite bound


def test_with_a_host_tier_the_tree_counts_blocks_only_the_host_holds():
    with LiveServer("--admin-api-key", "dash-admin", "--kv-host-cache-bytes", str(64 << 20)) as live:
        for i in range(16):  # 16 distinct prompts of 12 full blocks: more than the 128-block pool holds
            complete(live.url, [10 + i] * 200)
        live.wait_idle()
        tree = httpx.get(live.url + "/dashboard/api/snapshot", headers=ADMIN).json()["tree"]
        host_keys = live.engine.engine.tiers.tier_keys()["CPU"]
        tiers = {row["tier"]: row for row in tree["tiers"]}
        assert tiers["host"]["num_blocks"] == len(host_keys) > 0
        assert tiers["host"]["num_only_here"] > 0  # evicted from the pool, kept in host RAM
        assert tiers["device"]["num_blocks"] == tree["num_blocks"]
        complete(live.url, [10] * 200)  # the first prompt again: its blocks come back from host RAM
        live.wait_idle()
        tree = httpx.get(live.url + "/dashboard/api/snapshot", headers=ADMIN).json()["tree"]
        assert any("host" in node["copies"] for node in tree["nodes"])
