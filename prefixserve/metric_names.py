"""The names of the metrics prefixserve exposes, in one place.

The server's are under `prefixserve:` (after vLLM's `vllm:`), the router's under `prefixserve_router:`.
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
