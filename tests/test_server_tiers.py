"""The KV tiers through the server: usage says which tier served the prefix; /metrics counts per tier."""

import random

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer


def test_usage_and_metrics_report_each_tier(tmp_path):
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 8000) for _ in range(512)] + [7, 8, 9] for _ in range(5)]
    with LiveServer(
        "--kv-cache-memory-bytes",
        str(28 << 20),
        "--kv-host-cache-bytes",
        str(256 << 20),
        "--kv-disk-cache-dir",
        str(tmp_path),
        "--enable-kv-events",
        "--admin-api-key",
        "ops",
        "--kv-fetch-policy",
        "always",
    ) as server:  # exact tier counts, whatever this machine's speed

        def usage(prompt):
            response = httpx.post(
                server.url + "/v1/completions",
                timeout=120,
                json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]

        first = [usage(prompt) for prompt in prompts]
        second = [usage(prompt) for prompt in prompts]  # the pool holds 3 of them: each came back from host
        assert [details["cached_tokens_by_tier"]["device"] for details in first] == [0] * 5
        assert [details["cached_tokens_by_tier"] for details in second] == [
            {"device": 0, "host": 512, "disk": 0, "remote": 0}
        ] * 5
        assert [details["cached_tokens"] for details in second] == [512] * 5
        server.engine.engine.tiers["disk"].flush()  # the write-through to disk is in the background: let it land
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


def test_privacy_mode_from_the_keys_file_and_from_the_request(tmp_path):
    """A tenant whose keys-file entry says cache_retention "device", and a request that says "none", leave
    nothing in the disk tier; another tenant's request is written there; a bad value is a 422."""
    import json

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-private": {"tenant": "private", "cache_retention": "device"}, "key-open": "open"}))
    rng = random.Random(9)
    prompts = [[rng.randrange(10, 8000) for _ in range(160)] + [7, 8, 9] for _ in range(3)]
    with LiveServer("--api-keys-file", str(keys), "--kv-disk-cache-dir", str(tmp_path / "kv")) as server:

        def complete(key, prompt, **extra):
            return httpx.post(
                server.url + "/v1/completions",
                timeout=120,
                headers={"authorization": f"Bearer {key}"},
                json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
            )

        assert complete("key-private", prompts[0]).status_code == 200
        assert complete("key-private", prompts[0], cache_retention=None).status_code == 200  # cannot loosen it
        assert complete("key-open", prompts[1], cache_retention="none").status_code == 200
        assert complete("key-open", prompts[2]).status_code == 200
        bad = complete("key-open", prompts[2], cache_retention="forever")
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "cache_retention"
        disk = server.engine.engine.tiers["disk"]
        disk.flush()
        from prefixserve.tiers import read_header

        held = {read_header(data).token_ids for data in disk.get(disk.keys()) if data is not None}
    blocks = [{tuple(p[i : i + 16]) for i in range(0, 160, 16)} for p in prompts]
    assert not held & blocks[0] and not held & blocks[1] and blocks[2] <= held
