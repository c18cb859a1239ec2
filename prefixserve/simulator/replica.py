"""One simulated replica: the real RadixCache, an FCFS prefill queue and a decode batch.

Replica model: one prefill at a time, decode in a batch.

    arrival ─route─> FCFS queue ─wait─> prefill ─first token─> decode ─> done
                                 │             │                        │
                     match, acquire, allocate  insert full prompt      release
                                               blocks into the index   all blocks

    TTFT = queue wait + prefill seconds; blocks are held from prefill start to done.

With tiers below the pool (tier_model.py), admission continues the pool's hit
through host, disk and the shared remote; the engine's planner (choose_fetch,
under the fleet's kv_fetch_policy) picks how much of that run to read back, and the prefill then costs the fetch
plus the computation of the rest. Fetching holds the prefill slot (no overlap
with computing, as the planner assumes); fetched blocks enter the pool like
computed ones, and only computed blocks are written through to disk and remote.

Prefill is exclusive (it is compute bound). A decoding request lasts
output x decode_seconds_per_token and overlaps later prefills (as chunked
prefill lets it); each decoded token adds decode_seconds_per_token /
decode_batch_size of GPU work to the replica's busy time and load. The load a
policy sees is the replica's estimated outstanding work in seconds: queued
prefills (costed with their predicted hit), the rest of the running prefill
and the GPU share of the remaining decodes.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from prefixserve.cache import Block, RadixCache, max_hit_blocks
from prefixserve.tiers.policy import FetchPlan, choose_fetch

from ..router.costs import CostModel
from ..router.policies import RouteRequest
from ..traces.mooncake import TraceRequest
from .tier_model import ReplicaTiers

NO_FETCH = FetchPlan({}, 0, 0.0, 0.0)


class Job:
    __slots__ = (
        "request",
        "route",
        "estimate",
        "prefill_estimate",
        "start",
        "prefill_seconds",
        "blocks",
        "num_hit_blocks",
        "fetch",
        "done_at",
    )

    def __init__(self, request: TraceRequest, route: RouteRequest, prefill_estimate: float, estimate: float) -> None:
        self.request, self.route = request, route
        self.prefill_estimate, self.estimate = prefill_estimate, estimate  # predicted prefill; + decode work
        self.start = self.prefill_seconds = self.done_at = 0.0
        self.blocks: list[Block] = []
        self.num_hit_blocks = 0  # in the pool
        self.fetch = NO_FETCH  # read back from the tiers below it, right after the pool's hit


class SimulationClock:
    """Simulated seconds; the caches read it as their clock."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedReplica:
    """One replica: the real cache, an FCFS prefill queue and a decode batch. A `ReplicaView`."""

    job_type = Job  # what enqueue makes (steps.StepJob adds the step-level replay's progress)

    def __init__(
        self,
        index: int,
        capacity_blocks: int,
        cost: CostModel,
        block_size: int,
        clock: SimulationClock,
        tiers: Optional[ReplicaTiers] = None,
        fetch_policy: str = "cost",
    ) -> None:
        self.name = f"replica-{index}"
        self.cache = RadixCache(capacity_blocks, block_size=1, clock=clock)
        self.cost, self.block_size, self.clock = cost, block_size, clock
        self.tiers = tiers or ReplicaTiers()
        self.tier_costs = cost.tier_costs()
        self.fetch_policy = fetch_policy  # EngineConfig.kv_fetch_policy: "cost" or "always"
        self.block_bytes = int(cost.kv_bytes_per_token * block_size)
        if self.tiers.host is not None:
            self.cache.on_evict = self._spill
        self.queue: deque[Job] = deque()
        self.queued_work = 0.0  # predicted prefill + decode work of the queued jobs
        self.queued_prefill = 0.0  # predicted prefill of the queued jobs
        self.prefilling: Optional[Job] = None
        self.num_decoding = 0
        self.decode_done_sum = 0.0  # sum of done_at over decoding jobs: their remaining time in O(1)
        self.busy_seconds = 0.0
        self.num_failed_allocations = 0
        # keys that queued and prefilling jobs will insert -> how many such jobs: the router mirror's
        # optimistic update (router/fleet.py), so a prefix is sticky from the moment it is routed
        self.pending_keys: dict[bytes, int] = {}
        self._memo: tuple[Optional[RouteRequest], float, int, list] = (None, 0.0, 0, [])  # request, time, hit, run

    # ------------------------------------------------------------ ReplicaView
    def num_hit_blocks(self, request: RouteRequest) -> int:
        """The replica's own index (record_stats=False), a perfect mirror, continued by the keys that
        the jobs ahead in its queue will have inserted by the time this request's prefill starts."""
        return self._predict(request)[0]

    @property
    def num_requests_waiting(self) -> int:  # the vllm: metrics a gateway's scorer reads (gateway_policies.py)
        return len(self.queue)

    @property
    def num_requests_running(self) -> int:
        return self.num_decoding + (self.prefilling is not None)

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage().usage

    def lower_tier_run(self, request: RouteRequest) -> list[tuple[str, int]]:
        """The run after the pool's hit that host, disk and the shared remote hold, read from the tiers themselves."""
        return self._predict(request)[1]

    def _predict(self, request: RouteRequest) -> tuple[int, list[tuple[str, int]]]:
        memo_request, memo_time, memo_hit, memo_run = self._memo
        if memo_request is request and memo_time == self.clock.now:
            return memo_hit, memo_run
        hit = len(self.cache.match(request.scope_digest, request.keys, request.token_ids, record_stats=False).blocks)
        limit, pending = self._match_limit(request), self.pending_keys
        while hit < limit and request.keys[hit] in pending:
            hit += 1
        run = self.tiers.run(request.keys, hit, limit) if self.tiers else []
        self._memo = (request, self.clock.now, hit, run)
        return hit, run

    @staticmethod
    def _match_limit(route: RouteRequest) -> int:
        """Blocks a hit may cover: the full ones, never the last (the engine recomputes the last token)."""
        return max_hit_blocks(len(route.token_ids), 1, len(route.keys))  # one id a block

    def _plan(self, run: list[tuple[str, int]]) -> FetchPlan:
        if not run:
            return NO_FETCH
        return choose_fetch(
            self.fetch_policy,
            run,
            self.block_bytes,
            self.cost.prefill_seconds_per_token,
            self.block_size,
            self.tier_costs,
        )

    def _prefill_seconds(self, request: TraceRequest, num_hit_blocks: int, fetch: FetchPlan) -> float:
        num_cached_tokens = min((num_hit_blocks + fetch.num_fetch_blocks) * self.block_size, request.input_length)
        return fetch.fetch_seconds + self.cost.prefill_seconds(request.input_length, num_cached_tokens)

    @property
    def queue_seconds(self) -> float:
        """How long a prefill queued now would wait: the queued prefills and the rest of the running one.

        Decoding does not delay a prefill here (it overlaps, as with chunked prefill), so unlike
        `load` this leaves decode work out: it is the queue term of a TTFT estimate.
        """
        wait = self.queued_prefill
        if self.prefilling is not None:
            wait += self.prefilling.start + self.prefilling.prefill_seconds - self.clock.now
        return max(wait, 0.0)

    @property
    def load(self) -> float:
        now = self.clock.now
        load = self.queued_work + (self.decode_done_sum - self.num_decoding * now) / self.cost.decode_batch_size
        if self.prefilling is not None:
            job = self.prefilling
            load += job.start + job.prefill_seconds - now + self.cost.decode_work_seconds(job.request.output_length)
        return max(load, 0.0)

    # ------------------------------------------------------------- life cycle
    def enqueue(self, request: TraceRequest, route: RouteRequest) -> Job:
        hit, run = self._predict(route)
        prefill = self._prefill_seconds(request, hit, self._plan(run))
        self._memo = (None, 0.0, 0, [])  # starting a prefill may evict: predict afresh
        job = self.job_type(request, route, prefill, prefill + self.cost.decode_work_seconds(request.output_length))
        self.queue.append(job)
        for key in route.keys:
            self.pending_keys[key] = self.pending_keys.get(key, 0) + 1
        self.queued_work += job.estimate
        self.queued_prefill += job.prefill_estimate
        return job

    def start_prefill(self) -> Optional[Job]:
        """Admit the head of the queue if idle; returns the job whose prefill started."""
        if self.prefilling is not None or not self.queue:
            return None
        job = self.queue.popleft()
        self.queued_work = self.queued_work - job.estimate if self.queue else 0.0
        self.queued_prefill = self.queued_prefill - job.prefill_estimate if self.queue else 0.0
        request, route, cache = job.request, job.route, self.cache
        hit = cache.match(route.scope_digest, route.keys, route.token_ids)
        num_needed = self.num_blocks_needed(request) - len(hit.blocks)
        blocks = cache.admit(hit.blocks, num_needed)  # the engine scheduler's admission step
        if blocks is not None:
            job.blocks = blocks
            job.num_hit_blocks = len(hit.blocks)
            if self.tiers:  # after admission: its evictions spill to host, and may push host's LRU out
                run = self.tiers.run(route.keys, job.num_hit_blocks, self._match_limit(route))
                job.fetch = self._plan(run)
                self.tiers.read(route.keys, job.num_hit_blocks, run, job.fetch.num_fetch_blocks)
        else:  # running requests hold every block: compute it all, cache nothing
            self.num_failed_allocations += 1
        job.start = self.clock.now
        job.prefill_seconds = self._prefill_seconds(request, job.num_hit_blocks, job.fetch)
        self.prefilling = job
        return job

    def finish_prefill(self, job: Job) -> None:
        """Register the full prompt blocks (the partial tail has no key) and join the decode batch."""
        self.register_prompt(job)
        job.done_at = self.clock.now + self.cost.decode_seconds(job.request.output_length)
        self.num_decoding += 1
        self.decode_done_sum += job.done_at
        self.busy_seconds += job.prefill_seconds + self.cost.decode_work_seconds(job.request.output_length)

    def register_prompt(self, job: Job) -> None:
        """The prefill ended: insert its full blocks into the index, write the computed ones through, free the slot."""
        assert self.prefilling is job
        cache, route = self.cache, job.route
        if job.blocks:
            parent: Block | bytes = route.scope_digest
            first_computed = job.num_hit_blocks + job.fetch.num_fetch_blocks
            for i in range(len(route.keys)):
                if i >= job.num_hit_blocks:
                    job.blocks[i] = cache.insert(job.blocks[i], route.keys[i], route.token_ids[i : i + 1], parent)
                if i >= first_computed and self.tiers:
                    self.tiers.write_through(route.keys[i], route.keys[i - 1] if i else None)
                parent = job.blocks[i]
        for key in route.keys:
            if self.pending_keys[key] == 1:
                del self.pending_keys[key]
            else:
                self.pending_keys[key] -= 1
        self.prefilling = None

    def check_integrity(self) -> None:
        """After a replay (tests): the cache's invariants, no block still referenced, every tier within its size."""
        self.cache.check_integrity()
        assert self.cache.usage().num_referenced_blocks == 0, f"{self.name} leaked block references"
        for tier in self.tiers.tiers:
            tier.index.check_integrity()
            assert len(tier) <= tier.capacity_blocks, f"{self.name}'s {tier.name} tier is over capacity"

    def num_blocks_needed(self, request: TraceRequest) -> int:
        """Blocks a request holds while it runs: its prompt and its output."""
        return -(-(request.input_length + request.output_length) // self.block_size)

    def _spill(self, block: Block) -> None:
        parent = block.parent
        self.tiers.spill(block.key, parent.key if isinstance(parent, Block) else None)

    def finish(self, job: Job) -> None:
        self.cache.release(job.blocks)
        job.blocks = []
        self.num_decoding -= 1
        self.decode_done_sum = self.decode_done_sum - job.done_at if self.num_decoding else 0.0
