"""Tenants never share private prefixes; the declared public prefix is shared; /metrics moves, and answers only
the operator's admin or metrics key where tenants have keys (server and router), as the docs' scrape config sends it."""

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from docs_text import fenced, section
from prometheus_client.parser import text_string_to_metric_families
from router_fakes import LiveApp
from server_helpers import LiveServer, assert_openai_error

from prefixserve.router.app import RouterSettings, build_router_app

PUBLIC = "Company policy: be helpful, be brief, cite sources, never guess. " * 6
PRIVATE = "Tenant notes: project Falcon launches in March, budget is confidential. " * 6
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
ADMIN, METRICS = "ops-admin-key", "scraper-key"
ROUTER_METRICS = "router-scraper-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    keys = directory / "keys.json"
    keys.write_text(json.dumps(KEYS))
    prefix = directory / "system.txt"
    prefix.write_text(PUBLIC)
    with LiveServer(
        "--api-keys-file",
        str(keys),
        "--shared-prefix",
        str(prefix),
        "--admin-api-key",
        ADMIN,
        "--metrics-api-key",
        METRICS,
    ) as live:
        yield live


@pytest.fixture(scope="module")
def router(server, default_model_dir):
    settings = RouterSettings(
        replicas=(server.url,), api_keys=KEYS, admin_api_key=ADMIN, metrics_api_key=ROUTER_METRICS, health_interval=5.0
    )
    with LiveApp(build_router_app(settings)) as live:
        yield live


def ask(server, key, messages, **extra):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "prefixserve-tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra},
        timeout=60,
    )
    return response


def cached(response):
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_missing_or_wrong_key_is_401(server):
    assert ask(server, "nope", [{"role": "user", "content": "hi"}]).status_code == 401
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_private_prefix_is_not_shared_across_tenants(server):
    messages = [{"role": "system", "content": PRIVATE}, {"role": "user", "content": "When is the launch?"}]
    assert cached(ask(server, "key-a", messages)) == 0
    assert cached(ask(server, "key-a", messages)) > 0  # same tenant: hit
    assert cached(ask(server, "key-b", messages)) == 0  # other tenant: no cross-tenant reuse
    assert cached(ask(server, "key-b", messages)) > 0


def test_declared_public_prefix_is_shared_by_all_tenants(server):
    tokenizer = server.engine.engine.tokenizer
    public_ids = tokenizer.encode_chat([{"role": "system", "content": PUBLIC}], add_generation_prompt=False)
    public_full = len(public_ids) // 16 * 16
    first = [{"role": "system", "content": PUBLIC}, {"role": "user", "content": "Question from A"}]
    second = [{"role": "system", "content": PUBLIC}, {"role": "user", "content": "Question from B"}]
    cached(ask(server, "key-a", first))
    assert cached(ask(server, "key-b", second)) == public_full
    # ...but what A asked after the public prefix stays A's.
    assert cached(ask(server, "key-b", first)) == public_full


def scrape(server):
    response = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {METRICS}"}, timeout=10)
    assert response.status_code == 200, response.text
    text = response.text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_metrics_parse_and_hit_counters_move(server):
    before = scrape(server)
    messages = [{"role": "system", "content": PRIVATE + " metrics"}, {"role": "user", "content": "Count me"}]
    ask(server, "key-a", messages)
    ask(server, "key-a", messages)
    after = scrape(server)
    hits = ("prefixserve:prefix_cache_hits_total", ())
    assert after[hits] > before[hits]
    assert (
        after[("prefixserve:prefix_cache_queries_total", ())] > before[("prefixserve:prefix_cache_queries_total", ())]
    )
    assert after[("prefixserve:prefill_tokens_saved_total", ())] == after[hits]
    assert (
        after[("prefixserve:time_to_first_token_seconds_count", ())]
        >= before.get(("prefixserve:time_to_first_token_seconds_count", ()), 0) + 2
    )
    for state in ("free", "cached", "in_use", "pinned"):
        assert ("prefixserve:kv_blocks", (("state", state),)) in after
    assert 0.0 <= after[("prefixserve:kv_cache_usage_perc", ())] <= 1.0


BEARER, X_API_KEY = "authorization", "x-api-key"


def metrics_with(url: str, header: str = "", key: str = "") -> httpx.Response:
    value = f"Bearer {key}" if header == BEARER else key
    return httpx.get(url + "/metrics", headers={header: value} if header else {}, timeout=10)


@pytest.mark.parametrize("app, metrics_key", [("server", METRICS), ("router", ROUTER_METRICS)])
def test_metrics_answer_the_operators_keys_only(app, metrics_key, request):
    url = request.getfixturevalue(app).url
    assert_openai_error(metrics_with(url), 401, code="invalid_api_key")
    assert_openai_error(metrics_with(url, BEARER, "not-a-key"), 401, code="invalid_api_key")
    for header in (BEARER, X_API_KEY):
        assert_openai_error(metrics_with(url, header, "key-a"), 403, code="operator_only")
        for key in (metrics_key, ADMIN):
            response = metrics_with(url, header, key)
            assert response.status_code == 200, (header, key, response.text)
            assert list(text_string_to_metric_families(response.text))  # Prometheus's text format


def test_vllms_names_sit_behind_the_same_key(server):
    assert_openai_error(metrics_with(server.url, BEARER, "key-b"), 403, code="operator_only")
    assert "vllm:prefix_cache_hits_total" in metrics_with(server.url, BEARER, METRICS).text


def test_the_metrics_key_opens_nothing_else(server):
    headers = {"Authorization": f"Bearer {METRICS}"}
    for path in ("/v1/cache/stats", "/v1/cache/info", "/dashboard/api/snapshot", "/dashboard/api/price"):
        assert_openai_error(httpx.get(server.url + path, headers=headers, timeout=10), 401, code="invalid_api_key")
    assert_openai_error(
        httpx.post(server.url + "/v1/completions", headers=headers, json={"prompt": "hi"}, timeout=10),
        401,
        code="invalid_api_key",
    )
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}  # no counters there


def test_the_docs_curl_example_prints_what_is_shown(server):
    text = section("Scraping /metrics where tenants have keys")
    command = next(line for line in fenced(text, "bash")[0].splitlines() if line.startswith("curl"))
    path = re.search(r"http://127\.0\.0\.1:8000(/\S+)", command).group(1)
    assert "-H" not in command
    assert httpx.get(server.url + path, timeout=10).text + "\n" == fenced(text, "")[0]


def test_prometheus_scrapes_server_and_router_with_the_docs_config(server, router, tmp_path):
    """Each job of the docs' prometheus.yml scraped as Prometheus would: scheme and metrics_path (defaults http,
    /metrics), its `authorization` (type, credentials read from credentials_file beside prometheus.yml)."""
    config = yaml.safe_load(fenced(section("Scraping /metrics where tenants have keys"), "yaml")[0])
    (tmp_path / "metrics.key").write_text(METRICS + "\n")
    (tmp_path / "router-metrics.key").write_text(ROUTER_METRICS + "\n")
    live = {
        "127.0.0.1:8000": (server.url, "prefixserve:prefix_cache_queries_total"),
        "127.0.0.1:8080": (router.url, "prefixserve_router:routed_requests"),
    }
    scraped = []
    for job in config["scrape_configs"]:
        authorization = job["authorization"]
        credentials = authorization.get("credentials")
        if credentials is None:
            credentials = Path(tmp_path, authorization["credentials_file"]).read_text().strip()
        headers = {"Authorization": f"{authorization.get('type', 'Bearer')} {credentials}"}
        for target in job["static_configs"][0]["targets"]:
            url, family = live[target]
            path = job.get("metrics_path", "/metrics")
            assert job.get("scheme", "http") == "http"
            assert httpx.get(url + path, timeout=10).status_code == 401  # the key is what opens it
            response = httpx.get(url + path, headers=headers, timeout=10)
            assert response.status_code == 200, (job["job_name"], response.text)
            assert family in response.text
            scraped.append(job["job_name"])
    assert scraped == ["prefixserve", "prefixserve-router"]
