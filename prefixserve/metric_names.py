"""The names of the metrics prefixserve exposes, in one place.

The server's are under `prefixserve:` (after vLLM's `vllm:`), the router's under `prefixserve_router:`; the
server also exposes the model-server protocol's subset under vLLM's own names (`vllm:`, server/vllm_metrics.py),
which llm-d's endpoint picker, KServe's autoscaler, gateways and Grafana's vLLM dashboards query.
Producers (server/metrics.py, server/dashboard/recorder.py, router/fleet.py) and readers (the dashboard's
snapshot and what-if panels, the router's fleet view, `prefixserve plan price --url`) import them from
here instead of retyping strings. A counter named N is scraped as the sample N_total; a histogram as
N_bucket, N_count and N_sum. (The dashboard's JavaScript reads the snapshot's JSON, never these names.)
"""

SERVER_PREFIX = "prefixserve:"
ROUTER_PREFIX = "prefixserve_router:"


def server_metric(name: str) -> str:
    return SERVER_PREFIX + name


def router_metric(name: str) -> str:
    return ROUTER_PREFIX + name


def total(counter: str) -> str:
    """The sample name of a counter in Prometheus text."""
    return counter + "_total"


# read by more than the module that defines them
TENANT_KV_BLOCKS = server_metric("tenant_kv_blocks")  # gauge {tenant, state=held|min|max|pinned|pin_limit}
TENANT_TIER_BYTES = server_metric("tenant_kv_tier_bytes")  # gauge {tenant, tier}: bytes of a tier a tenant holds
PREFIX_CACHE_QUERIES = server_metric("prefix_cache_queries")  # counter: prompt tokens looked up
PREFIX_CACHE_HITS = server_metric("prefix_cache_hits")  # counter: prompt tokens served from the cache
PREFIX_CACHE_REQUESTS = server_metric("prefix_cache_requests")  # counter: requests looked up
TTFT = server_metric("time_to_first_token_seconds")  # histogram
TTFT_BY_CACHE = server_metric("time_to_first_token_by_cache_seconds")  # histogram, label cache="hit"|"miss"
E2E_LATENCY = server_metric("e2e_request_latency_seconds")  # histogram
KV_BLOCKS = server_metric("kv_blocks")  # gauge, label state
PREFIX_REUSE_GAP = server_metric("prefix_reuse_gap_seconds")  # histogram
KV_TIER_HIT_TOKENS = server_metric("kv_tier_hit_tokens")  # counter, label tier
KV_TIER_USED_BYTES = server_metric("kv_tier_used_bytes")  # gauge, label tier
KV_TIER_CAPACITY_BYTES = server_metric("kv_tier_capacity_bytes")  # gauge, label tier
KV_TIER_REJECTIONS = server_metric("kv_tier_rejections")  # counter, labels tier, reason
KV_TIER_FETCH_SECONDS = server_metric("kv_tier_fetch_seconds")  # histogram, label tier

ROUTED_REQUESTS = router_metric("routed_requests")  # counter, label replica
PREDICTED_HIT_TOKENS = router_metric("predicted_hit_tokens")
FAILOVERS = router_metric("failovers")
CONTINUED_STREAMS = router_metric("continued_streams")
CACHE_KEY_ROUTES = router_metric("cache_key_routes")  # counter, label outcome: kept | overflowed
PREFILLS = router_metric("prefills")  # counter, label outcome: done | refused | skipped (no prefill replica answered)
REPLICA_LOAD_SECONDS = router_metric("replica_load_seconds")  # gauge
REPLICA_HEALTHY = router_metric("replica_healthy")  # gauge

# vLLM's names, types and labels (labels model_name, engine; cache_config_info: its config fields and engine).
# Pods without an engine label are read as vLLM by the Gateway API Inference Extension, so these must mean
# what vLLM's mean.
VLLM_PREFIX = "vllm:"
VLLM_LABELS = ("model_name", "engine")
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0-1: blocks held by requests
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"  # gauge (a timestamp), labels max_lora, running/waiting names
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"  # gauge 1, labels block_size, num_gpu_blocks, ...
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter, tokens
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter, tokens
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"  # counter
VLLM_REQUEST_SUCCESS = "vllm:request_success"  # counter, label finished_reason
VLLM_NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter
VLLM_TTFT = "vllm:time_to_first_token_seconds"  # histogram
VLLM_E2E_LATENCY = "vllm:e2e_request_latency_seconds"  # histogram
VLLM_INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # histogram
VLLM_SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"  # counter: steps a request was drafted for
VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"  # counter
VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"  # counter
VLLM_SPEC_DECODE_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # counter, label position
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")  # request_success series present from the start
