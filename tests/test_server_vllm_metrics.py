"""The model-server protocol's metrics under vLLM's names (server/vllm_metrics.py): what llm-d's picker,
KServe's autoscaler and Grafana's vLLM dashboards query reads true values, with vLLM's types and labels."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import LiveServer

MODEL = "tiny-replica"
SHARED = "You are a careful assistant. Answer in one short sentence, and cite the manual. " * 4
LABELS = {"model_name": MODEL, "engine": "0"}


@pytest.fixture(scope="module")
def server():
    with LiveServer("--served-model-name", MODEL) as live:
        yield live


def scrape(server) -> dict[str, tuple[str, list]]:
    """vllm:* family name -> (type, samples)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        family.name: (family.type, family.samples)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:")
    }


def value(families, family: str, sample: str = None, **labels) -> float:
    _, samples = families[family]
    matches = [
        s.value
        for s in samples
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (family, sample, labels, samples)
    return matches[0]


def test_vllm_names_types_and_labels(server):
    families = scrape(server)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
    }
    assert {name: families[name][0] for name in expected} == expected
    for name in expected:
        if name != "vllm:cache_config_info":
            assert all(sample.labels.items() >= LABELS.items() for sample in families[name][1]), name
    (info,) = families["vllm:cache_config_info"][1]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["engine"] == "0"
    assert int(info.labels["num_gpu_blocks"]) == server.engine.engine.cache.pool.num_blocks
    bounds = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"][1] if s.name.endswith("_bucket")]
    assert bounds[:3] == ["0.001", "0.005", "0.01"] and bounds[-1] == "+Inf"  # vLLM's buckets


def test_counters_and_histograms_read_what_the_responses_said(server):
    before = scrape(server)
    usages = []
    for question in ("What is a block?", "What is a prefix?", "What is a tier?"):
        body = {"model": MODEL, "prompt": SHARED + question, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        usages.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"])
    server.wait_idle()
    after = scrape(server)

    def moved(family, sample=None, **labels):
        return value(after, family, sample, **{**LABELS, **labels}) - value(
            before, family, sample, **{**LABELS, **labels}
        )

    num_prompt = sum(usage["prompt_tokens"] for usage in usages)
    num_output = sum(usage["completion_tokens"] for usage in usages)
    num_cached = sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)
    assert num_cached > 0
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == num_prompt
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == num_output
    assert moved("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == num_prompt
    assert moved("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == num_cached
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert moved("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == num_output - 3
    assert value(after, "vllm:num_requests_running", **LABELS) == 0
    assert value(after, "vllm:kv_cache_usage_perc", **LABELS) == 0  # cached blocks are free to vLLM too


def test_a_running_request_shows_as_running_and_a_dropped_stream_as_aborted(server):
    before = scrape(server)
    body = {"model": MODEL, "prompt": SHARED, "max_tokens": 1200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():  # (scraped inside the loop: leaving it closes the stream)
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"] is not None:
                during = scrape(server)  # the request is generating, 1,200 tokens to go
                break
    server.wait_idle()
    after = scrape(server)
    assert value(during, "vllm:num_requests_running", **LABELS) == 1
    assert value(during, "vllm:kv_cache_usage_perc", **LABELS) > 0
    aborted = {**LABELS, "finished_reason": "abort"}
    assert (
        value(after, "vllm:request_success", "vllm:request_success_total", **aborted)
        - value(before, "vllm:request_success", "vllm:request_success_total", **aborted)
    ) == 1
