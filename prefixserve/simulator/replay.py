"""Replay a trace over N simulated replicas, each running the real RadixCache, and compare routing policies.

Granularity: a trace block id stands for `trace.block_size` (512) real tokens.
Each replica runs `RadixCache(capacity_blocks, block_size=1)` whose "tokens"
are block ids, with chained keys from `BlockKeyer(1)`: key_i = H(key_{i-1}, id_i),
key_{-1} = the digest of one fixed CacheScope. So capacity is counted in trace
blocks, and the cache keeps its own rules: the partial tail block is never
cached, and the last block is never a hit (the engine recomputes the last token).

A replica (replica.py) runs one prefill at a time and decodes in a batch; below its pool it may
have a host and a disk tier, and the fleet may share a remote tier (tier_model.py). This file is one
concept (the replay; tables and plots are in report.py; `prefixserve simulate` is in commands/).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from ..cache import max_hit_blocks
from ..config import FETCH_POLICIES
from ..router.costs import TIER_NAMES, CostModel, policy_options_for
from ..router.policies import RouteRequest, RoutingPolicy
from ..router.policy_options import PolicyOptions
from ..router.policy_registry import make_policy
from ..traces.agents import AgentTraceConfig, generate_agent_trace
from ..traces.mooncake import TRACE_SCOPE, Trace, block_keys
from .replica import Job, SimulatedReplica, SimulationClock
from .report import BOUND_NAME
from .tier_model import ReplicaTiers, SimulatedTier

# Llama-3-8B in bf16 keeps 128 KiB of KV per token; an 80 GB H100 has about 64 GiB left after
# weights and activations: 512 Ki tokens, i.e. about 1,000 blocks of 512 tokens per replica.
DEFAULT_CAPACITY_BLOCKS = 1000


@dataclass(frozen=True)
class SimulationConfig:
    num_replicas: int = 8
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS  # per replica, in trace blocks
    cost: CostModel = field(default_factory=CostModel)
    host_blocks: int = 0  # per replica, in trace blocks; 0: no host tier
    disk_blocks: int = 0  # per replica; 0: no disk tier
    remote_blocks: int = 0  # one store for the whole fleet; 0: no remote tier
    fetch_policy: str = "cost"  # the replicas' kv_fetch_policy: "cost" (fetch what beats recomputing) or "always"
    seed: int = 0
    policy_options: Optional[PolicyOptions] = None  # None: seeded, kv_aware weighted from `cost`
    progress: bool = False
    check_integrity: bool = False  # tests: verify every replica's cache after the replay

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas (--replicas) must be at least 1, got {self.num_replicas}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks (--capacity-blocks) must be at least 1, got {self.capacity_blocks}")
        for tier in TIER_NAMES:
            if getattr(self, f"{tier}_blocks") < 0:
                raise ValueError(
                    f"{tier}_blocks (--{tier}-blocks) must be 0 (no {tier} tier) or more, "
                    f"got {getattr(self, f'{tier}_blocks')}"
                )
        if self.fetch_policy not in FETCH_POLICIES:
            raise ValueError(
                f"fetch_policy (--kv-fetch-policy) must be one of {', '.join(FETCH_POLICIES)}, "
                f"got {self.fetch_policy!r}"
            )

    def tier_factory(self) -> Callable[[], ReplicaTiers]:
        """Each call: one replica's own host and disk tiers (as sized) above the one remote tier the fleet shares."""
        remote = SimulatedTier("remote", self.remote_blocks) if self.remote_blocks else None

        def tiers() -> ReplicaTiers:
            return ReplicaTiers(
                SimulatedTier("host", self.host_blocks) if self.host_blocks else None,
                SimulatedTier("disk", self.disk_blocks) if self.disk_blocks else None,
                remote,
            )

        return tiers

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers below the pool this fleet has, in fetch order."""
        return tuple(tier for tier in TIER_NAMES if getattr(self, f"{tier}_blocks"))

    def options_for(self) -> PolicyOptions:
        """Policy options scaled to the cost model, so scaling every cost cannot change a routing decision."""
        if self.policy_options is not None:
            return self.policy_options
        return policy_options_for(self.cost, self.seed)


@dataclass
class SimulationResult:
    policy: str
    num_requests: int
    num_input_tokens: int
    num_hit_tokens: int
    load_imbalance: float = math.nan  # max / mean busy seconds over replicas
    queue_p50: float = math.nan  # seconds
    queue_p99: float = math.nan
    ttft_p50: float = math.nan
    ttft_p99: float = math.nan
    num_failed_allocations: int = 0  # requests that found every block referenced: computed, not cached
    num_evicted_blocks: int = 0
    # hit tokens by where they came from: "device" (the pool), then each tier below it the fleet has
    num_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Token-weighted: prompt tokens served from cache (the pool or a tier below it) / prompt tokens."""
        return self.num_hit_tokens / self.num_input_tokens if self.num_input_tokens else 0.0

    def tier_hit_rate(self, tier: str) -> float:
        """Share of prompt tokens served from `tier` ("device" is the pool); NaN if the run had no such tier."""
        if tier not in self.num_hit_tokens_by_tier or not self.num_input_tokens:
            return math.nan
        return self.num_hit_tokens_by_tier[tier] / self.num_input_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_input_tokens - self.num_hit_tokens

    def metrics(self) -> dict[str, Optional[float]]:
        values = {
            "hit_rate": self.hit_rate,
            "prefill_tokens": self.num_prefill_tokens,
            "load_imbalance": self.load_imbalance,
            "queue_p50_s": self.queue_p50,
            "queue_p99_s": self.queue_p99,
            "ttft_p50_s": self.ttft_p50,
            "ttft_p99_s": self.ttft_p99,
            "num_requests": self.num_requests,
            "num_failed_allocations": self.num_failed_allocations,
            "num_evicted_blocks": self.num_evicted_blocks,
            **{f"{tier}_hit_rate": self.tier_hit_rate(tier) for tier in self.num_hit_tokens_by_tier},
        }
        return json_ready(values)


def json_ready(values: dict) -> dict:
    """NaN (a metric with no sample) as None, which JSON can write."""
    return {name: None if isinstance(v, float) and math.isnan(v) else v for name, v in values.items()}


def prepare_routes(trace: Trace) -> list[RouteRequest]:
    """Chained keys of every request's full blocks, computed once and shared by all policy runs."""
    scope = TRACE_SCOPE.digest
    return [
        RouteRequest(keys, r.hash_ids, scope, len(r.hash_ids), trace.block_size)
        for r, keys in zip(trace.requests, block_keys(trace))
    ]


_PREFILL_DONE, _DONE = 0, 1


def simulate(
    trace: Trace,
    policy: str | RoutingPolicy,
    config: SimulationConfig = SimulationConfig(),
    routes: Optional[Sequence[RouteRequest]] = None,
) -> SimulationResult:
    """Replay `trace` over `config.num_replicas` replicas routed by `policy`.

    A policy object keeps state (round robin's counter, power_of_two's sampler);
    pass a name to start from a fresh one. `routes` (from `prepare_routes`)
    saves rehashing the trace when several policies replay it.
    """
    if isinstance(policy, str):
        policy = make_policy(policy, config.options_for())
    routes = prepare_routes(trace) if routes is None else routes
    if len(routes) != len(trace.requests):
        raise ValueError(f"{len(routes)} routes for {len(trace.requests)} requests; use prepare_routes(trace)")
    if any(later.arrival_time < earlier.arrival_time for earlier, later in zip(trace.requests, trace.requests[1:])):
        raise ValueError("trace requests must be in arrival order; sort them by arrival_time")
    replay = _Replay(trace, config)
    # disable=None: a bar only on a terminal, never thousands of redraws in a log file or a pipe
    progress = tqdm(
        total=len(trace.requests), desc=policy.name, unit="req", leave=False, disable=None if config.progress else True
    )
    for request, route in zip(trace.requests, routes):
        replay.run_events(request.arrival_time)  # completions at the arrival instant happen first
        replay.clock.now = request.arrival_time
        index = policy.choose(route, replay.replicas)
        replay.replicas[index].enqueue(request, route)
        replay.start(index)
        progress.update()
    progress.close()
    replay.run_events(math.inf)
    return replay.result(policy.name)


class _Replay:
    """The event loop of one replay: replicas on one simulated clock, prefill-done and done events."""

    def __init__(self, trace: Trace, config: SimulationConfig) -> None:
        self.trace, self.config = trace, config
        self.clock = SimulationClock()
        tiers = config.tier_factory()
        self.replicas = [
            SimulatedReplica(
                i, config.capacity_blocks, config.cost, trace.block_size, self.clock, tiers(), config.fetch_policy
            )
            for i in range(config.num_replicas)
        ]
        self.events: list[tuple[float, int, int, int, Job]] = []  # (time, sequence, kind, replica, job)
        self.sequence = itertools.count()  # orders events at the same instant: first scheduled, first run
        self.waits: list[float] = []
        self.ttfts: list[float] = []
        self.num_hit_tokens_by_tier = dict.fromkeys(("device", *config.tier_names), 0)

    def start(self, index: int) -> None:
        job = self.replicas[index].start_prefill()
        if job is not None:
            heapq.heappush(
                self.events, (job.start + job.prefill_seconds, next(self.sequence), _PREFILL_DONE, index, job)
            )

    def run_events(self, until: float) -> None:
        events = self.events
        while events and events[0][0] <= until:
            self.clock.now, _, kind, index, job = heapq.heappop(events)
            replica = self.replicas[index]
            if kind == _PREFILL_DONE:
                replica.finish_prefill(job)
                size, by_tier = self.trace.block_size, self.num_hit_tokens_by_tier
                by_tier["device"] += job.num_hit_blocks * size
                for tier, num_blocks in job.fetch.num_fetch_blocks_by_tier.items():
                    by_tier[tier] += num_blocks * size
                self.waits.append(job.start - job.request.arrival_time)
                self.ttfts.append(job.start + job.prefill_seconds - job.request.arrival_time)
                heapq.heappush(events, (job.done_at, next(self.sequence), _DONE, index, job))
                self.start(index)
            else:
                replica.finish(job)

    def result(self, policy_name: str) -> SimulationResult:
        replicas, trace = self.replicas, self.trace
        if self.config.check_integrity:
            for replica in replicas:
                replica.check_integrity()
        busy = [replica.busy_seconds for replica in replicas]
        mean_busy = sum(busy) / len(busy)
        return SimulationResult(
            policy=policy_name,
            num_requests=len(trace.requests),
            num_input_tokens=trace.num_input_tokens,
            num_hit_tokens=sum(self.num_hit_tokens_by_tier.values()),
            load_imbalance=max(busy) / mean_busy if mean_busy else 1.0,
            queue_p50=_percentile(self.waits, 50),
            queue_p99=_percentile(self.waits, 99),
            ttft_p50=_percentile(self.ttfts, 50),
            ttft_p99=_percentile(self.ttfts, 99),
            num_failed_allocations=sum(replica.num_failed_allocations for replica in replicas),
            num_evicted_blocks=sum(replica.cache.stats.num_evicted_blocks for replica in replicas),
            num_hit_tokens_by_tier=dict(self.num_hit_tokens_by_tier),
        )


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def infinite_cache_bound(trace: Trace, routes: Optional[Sequence[RouteRequest]] = None) -> SimulationResult:
    """One shared cache that never evicts and sees every earlier prompt: no routing can beat its hit rate."""
    routes = prepare_routes(trace) if routes is None else routes
    seen: set[bytes] = set()
    num_hit_blocks = 0
    for route in routes:
        limit = max_hit_blocks(route.num_blocks, 1, len(route.keys))
        hit = 0
        while hit < limit and route.keys[hit] in seen:
            hit += 1
        num_hit_blocks += hit
        seen.update(route.keys)
    return SimulationResult(BOUND_NAME, len(trace.requests), trace.num_input_tokens, num_hit_blocks * trace.block_size)


def uncached_utilization(trace: Trace, config: SimulationConfig = SimulationConfig()) -> float:
    """The share of the fleet's prefill time the trace would take with no prefix cache: a load scale that
    does not depend on routing. Below 1 a cache-less fleet keeps up; the cache is what makes 2 or 5 light."""
    work = sum(config.cost.prefill_seconds(request.input_length, 0) for request in trace.requests)
    return work / (config.num_replicas * max(trace.duration, 1.0))


def compare_policies(
    trace: Trace,
    policies: Sequence[str],
    config: SimulationConfig = SimulationConfig(),
    routes: Optional[Sequence[RouteRequest]] = None,
) -> list[SimulationResult]:
    """One result per policy, then the infinite-cache bound row."""
    for name in policies:
        make_policy(name)  # unknown names fail before any replay starts
    routes = prepare_routes(trace) if routes is None else routes
    return [simulate(trace, name, config, routes) for name in policies] + [infinite_cache_bound(trace, routes)]


def capacity_sweep(
    trace: Trace, policies: Sequence[str], capacities: Sequence[int], config: SimulationConfig = SimulationConfig()
) -> dict[int, list[SimulationResult]]:
    """Hit rate against cache size: capacity -> results (bound row last, the same at every size)."""
    routes = prepare_routes(trace)
    return {
        capacity: compare_policies(trace, policies, replace(config, capacity_blocks=capacity), routes)
        for capacity in capacities
    }


def agent_trace_at_load(load: float, seed: int = 0, agent: AgentTraceConfig = AgentTraceConfig()) -> Trace:
    """The agent workload of `agent`'s knobs with `load` x its sessions, started `load` x as fast."""
    return generate_agent_trace(replace(agent.at_load(load), seed=seed))


def load_sweep(
    policies: Sequence[str],
    loads: Sequence[float],
    config: SimulationConfig = SimulationConfig(),
    agent: AgentTraceConfig = AgentTraceConfig(),
) -> dict[float, list[SimulationResult]]:
    """Agent sessions from light to saturating load: load factor -> results (bound row last), seeded by config.seed."""
    return {load: compare_policies(agent_trace_at_load(load, config.seed, agent), policies, config) for load in loads}


def working_set_blocks(routes: Sequence[RouteRequest]) -> int:
    """Distinct full blocks over the trace: what a tier must hold to keep every prefix ever computed."""
    return len({key for route in routes for key in route.keys})
