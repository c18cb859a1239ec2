"""The KV tiers through the server: usage says which tier served the prefix; /metrics counts per tier."""

import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import LiveServer


def test_usage_and_metrics_report_each_tier(tmp_path):
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 8000) for _ in range(512)] + [7, 8, 9] for _ in range(5)]
    with LiveServer("--kv-cache-memory-bytes", str(28 << 20), "--kv-host-cache-bytes", str(256 << 20),
                    "--kv-disk-cache-dir", str(tmp_path), "--enable-kv-events", "--admin-api-key", "ops",
                    "--kv-fetch-policy", "always") as server:  # exact tier counts, whatever this machine's speed
        def usage(prompt):
            response = httpx.post(server.url + "/v1/completions", timeout=120,
                                  json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]

        first = [usage(prompt) for prompt in prompts]
        second = [usage(prompt) for prompt in prompts]  # the pool holds 3 of them: each came back from host
        assert [details["cached_tokens_by_tier"]["device"] for details in first] == [0] * 5
        assert [details["cached_tokens_by_tier"] for details in second] == [
            {"device": 0, "host": 512, "disk": 0, "remote": 0}] * 5
        assert [details["cached_tokens"] for details in second] == [512] * 5
        server.engine.engine.tiers.disk.flush()  # the write-through to disk is in the background: let it land
        text = httpx.get(server.url + "/metrics", timeout=10).text
        snapshot = httpx.get(server.url + "/v1/cache/keys", headers={"Authorization": "Bearer ops"}, timeout=10).json()
    assert set(snapshot["tiers"]) == {"CPU", "DISK"}  # a router resyncs each tier's keys from here
    assert len(snapshot["tiers"]["CPU"]) >= 2 * 32 and len(snapshot["tiers"]["DISK"]) >= 5 * 32
    values = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values[("prefixserve:kv_tier_hit_tokens_total", "host")] == 5 * 512
    assert values[("prefixserve:kv_tier_fetch_seconds_count", "host")] == 5
    assert values[("prefixserve:kv_tier_bytes_written_total", "disk")] > 0
    assert values[("prefixserve:kv_tier_capacity_bytes", "host")] == 256 << 20
    assert values[("prefixserve:kv_tier_rejected_records_total", "disk")] == 0
