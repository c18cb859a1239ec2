"""The model-server protocol's metrics under vLLM's names, types, labels and buckets, beside ours.

llm-d's endpoint picker and the Gateway API Inference Extension read a pod without an engine label as vLLM
(`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`), KServe autoscales on
them and Grafana's vLLM dashboards chart the rest; so each must mean what vLLM's means:

    num_requests_running / waiting   requests in the running batch / waiting for admission
    kv_cache_usage_perc              blocks held by requests / pool blocks (cached-but-free blocks are free,
                                     as in vLLM's block pool)
    prefix_cache_queries / hits      prompt tokens looked up / served from the device pool
    prompt_tokens / generation_tokens  whole prompts (at their first token) / output tokens
    request_success{finished_reason} finished requests by reason (stop, length, abort, error)
    spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _num_accepted_tokens_per_pos{position}
                                     with speculative_config: drafts (one per drafted request and step),
                                     tokens drafted, drafted tokens accepted, accepted at each draft position

Counters and gauges are read from the engine snapshot at scrape time; the three latency histograms are
observed per finished request with vLLM's default buckets (vllm/v1/metrics/buckets.py).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.async_engine import EngineSnapshot
from ..metric_names import (
    VLLM_CACHE_CONFIG_INFO,
    VLLM_E2E_LATENCY,
    VLLM_FINISH_REASONS,
    VLLM_GENERATION_TOKENS,
    VLLM_INTER_TOKEN_LATENCY,
    VLLM_KV_CACHE_USAGE,
    VLLM_LABELS,
    VLLM_LORA_REQUESTS_INFO,
    VLLM_NUM_PREEMPTIONS,
    VLLM_NUM_REQUESTS_RUNNING,
    VLLM_NUM_REQUESTS_WAITING,
    VLLM_PREFIX_CACHE_HITS,
    VLLM_PREFIX_CACHE_QUERIES,
    VLLM_PROMPT_TOKENS,
    VLLM_REQUEST_SUCCESS,
    VLLM_SPEC_DECODE_ACCEPTED_PER_POS,
    VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS,
    VLLM_SPEC_DECODE_NUM_DRAFTS,
    VLLM_TTFT,
)

ENGINE_INDEX = "0"  # one engine per replica
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class VLLMEngineCollector:
    """vLLM's gauges and counters, read from the engine snapshot when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str, cache_info: dict[str, str]) -> None:
        self.snapshot = snapshot
        self.labels = [model_name, ENGINE_INDEX]
        self.cache_info = {**cache_info, "engine": ENGINE_INDEX}

    def _family(self, family_class, name: str, documentation: str, value: float):
        family = family_class(name, documentation, labels=VLLM_LABELS)
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        snapshot = self.snapshot()
        stats, usage = snapshot.stats, snapshot.usage
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(
            gauge, VLLM_NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", snapshot.num_running
        )
        yield self._family(
            gauge, VLLM_NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", snapshot.num_waiting
        )
        yield self._family(gauge, VLLM_KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", usage.usage)
        yield self._family(
            counter,
            VLLM_PREFIX_CACHE_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.num_query_tokens,
        )
        yield self._family(
            counter,
            VLLM_PREFIX_CACHE_HITS,
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.num_hit_tokens,
        )
        yield self._family(
            counter, VLLM_PROMPT_TOKENS, "Number of prefill tokens processed.", snapshot.num_prompt_tokens
        )
        yield self._family(
            counter, VLLM_GENERATION_TOKENS, "Number of generation tokens processed.", snapshot.num_generation_tokens
        )
        yield self._family(
            counter, VLLM_NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.", snapshot.num_preemptions
        )
        success = CounterMetricFamily(
            VLLM_REQUEST_SUCCESS, "Count of successfully processed requests.", labels=[*VLLM_LABELS, "finished_reason"]
        )
        finished = snapshot.num_finished_by_reason
        for reason in sorted(set(VLLM_FINISH_REASONS) | set(finished)):
            success.add_metric([*self.labels, reason], finished.get(reason, 0))
        yield success
        info = GaugeMetricFamily(
            VLLM_CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", labels=list(self.cache_info)
        )
        info.add_metric(list(self.cache_info.values()), 1)
        yield info
        if snapshot.lora is not None:  # vLLM's: the adapters running and waiting, as comma-joined names
            max_lora, running, waiting = snapshot.lora
            lora = GaugeMetricFamily(
                VLLM_LORA_REQUESTS_INFO,
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric([str(max_lora), ",".join(waiting), ",".join(running)], snapshot.time)
            yield lora
        if snapshot.spec_decode is not None:  # vLLM's speculative-decoding counters
            yield from self._spec_decode(snapshot.spec_decode)

    def _spec_decode(self, spec):
        counter = CounterMetricFamily
        yield self._family(counter, VLLM_SPEC_DECODE_NUM_DRAFTS, "Number of spec decoding drafts.", spec.num_drafts)
        yield self._family(counter, VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS, "Number of draft tokens.", spec.num_draft_tokens)
        yield self._family(
            counter, VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Number of accepted tokens.", spec.num_accepted_tokens
        )
        per_position = CounterMetricFamily(
            VLLM_SPEC_DECODE_ACCEPTED_PER_POS,
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        for position, accepted in enumerate(spec.accepted_per_position):
            per_position.add_metric([*self.labels, str(position)], accepted)
        yield per_position


class VLLMLatencies:
    """vLLM's three latency histograms, observed once per finished request."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            return Histogram(name, documentation, VLLM_LABELS, buckets=buckets, registry=registry).labels(
                model_name, ENGINE_INDEX
            )

        self.ttft = histogram(VLLM_TTFT, "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.e2e_latency = histogram(
            VLLM_E2E_LATENCY, "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            VLLM_INTER_TOKEN_LATENCY, "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS
        )

    def observe(self, metrics) -> None:
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.e2e_latency is not None:
            self.e2e_latency.observe(metrics.e2e_latency)
        for interval in metrics.inter_token_latencies:
            self.inter_token_latency.observe(interval)


def cache_config_info(queries) -> dict[str, str]:
    """vllm:cache_config_info's labels for an engine (EngineQueries; vLLM's CacheConfig field names, as strings)."""
    return {
        "block_size": str(queries.block_size),
        "num_gpu_blocks": str(queries.num_blocks),
        "enable_prefix_caching": str(queries.enable_prefix_caching),
        "cache_dtype": "auto",
        "prefix_caching_hash_algo": queries.prefix_hash,
    }
