"""Tenants never share private prefixes; the declared public prefix is shared; /metrics moves."""

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer

PUBLIC = "Company policy: be helpful, be brief, cite sources, never guess. " * 6
PRIVATE = "Tenant notes: project Falcon launches in March, budget is confidential. " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    keys = directory / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    prefix = directory / "system.txt"
    prefix.write_text(PUBLIC)
    with LiveServer("--api-keys-file", str(keys), "--shared-prefix", str(prefix)) as live:
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
    text = httpx.get(server.url + "/metrics", timeout=10).text
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
