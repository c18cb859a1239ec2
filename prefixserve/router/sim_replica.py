"""One simulated replica: the real RadixCache, an FCFS prefill queue and a decode batch.

Replica model: one prefill at a time, decode in a batch.

    arrival ─route─> FCFS queue ─wait─> prefill ─first token─> decode ─> done
                                 │             │                        │
                     match, acquire, allocate  insert full prompt      release
                                               blocks into the index   all blocks

    TTFT = queue wait + prefill seconds; blocks are held from prefill start to done.

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

from prefixserve.cache import Block, RadixCache

from .costs import CostModel
from .policies import RouteRequest
from .traces import TraceRequest


class Job:
    __slots__ = ("request", "route", "estimate", "start", "prefill_seconds", "blocks", "num_hit_blocks", "done_at")

    def __init__(self, request: TraceRequest, route: RouteRequest, estimate: float) -> None:
        self.request, self.route, self.estimate = request, route, estimate
        self.start = self.prefill_seconds = self.done_at = 0.0
        self.blocks: list[Block] = []
        self.num_hit_blocks = 0


class SimulationClock:
    """Simulated seconds; the caches read it as their clock."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedReplica:
    """One replica: the real cache, an FCFS prefill queue and a decode batch. A `ReplicaView`."""

    def __init__(self, index: int, capacity_blocks: int, cost: CostModel, block_size: int, clock: SimulationClock) -> None:
        self.name = f"replica-{index}"
        self.cache = RadixCache(capacity_blocks, block_size=1, clock=clock)
        self.cost, self.block_size, self.clock = cost, block_size, clock
        self.queue: deque[Job] = deque()
        self.queued_work = 0.0
        self.prefilling: Optional[Job] = None
        self.num_decoding = 0
        self.decode_done_sum = 0.0  # sum of done_at over decoding jobs: their remaining time in O(1)
        self.busy_seconds = 0.0
        self.num_failed_allocations = 0
        self._memo: tuple[Optional[RouteRequest], float, int] = (None, 0.0, 0)  # (request, time, hit)

    # ------------------------------------------------------------ ReplicaView
    def num_hit_blocks(self, request: RouteRequest) -> int:
        """The prediction reads the replica's own index (record_stats=False): a perfect mirror."""
        memo_request, memo_time, memo_hit = self._memo
        if memo_request is request and memo_time == self.clock.now:
            return memo_hit
        hit = len(self.cache.match(request.scope_digest, request.keys, request.token_ids, record_stats=False).blocks)
        self._memo = (request, self.clock.now, hit)
        return hit

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
        predicted = self.num_hit_blocks(route) * self.block_size
        estimate = (self.cost.prefill_seconds(request.input_length, predicted)
                    + self.cost.decode_work_seconds(request.output_length))
        self._memo = (None, 0.0, 0)  # starting a prefill may evict: predict afresh
        job = Job(request, route, estimate)
        self.queue.append(job)
        self.queued_work += estimate
        return job

    def start_prefill(self) -> Optional[Job]:
        """Admit the head of the queue if idle; returns the job whose prefill started."""
        if self.prefilling is not None or not self.queue:
            return None
        job = self.queue.popleft()
        self.queued_work = self.queued_work - job.estimate if self.queue else 0.0
        request, route, cache = job.request, job.route, self.cache
        hit = cache.match(route.scope_digest, route.keys, route.token_ids)
        num_needed = -(-(request.input_length + request.output_length) // self.block_size) - len(hit.blocks)
        blocks = cache.admit(hit.blocks, num_needed)  # the engine scheduler's admission step
        if blocks is not None:
            job.blocks = blocks
            job.num_hit_blocks = len(hit.blocks)
        else:  # running requests hold every block: compute it all, cache nothing
            self.num_failed_allocations += 1
        job.start = self.clock.now
        job.prefill_seconds = self.cost.prefill_seconds(request.input_length, job.num_hit_blocks * self.block_size)
        self.prefilling = job
        return job

    def finish_prefill(self, job: Job) -> None:
        """Register the full prompt blocks (the partial tail has no key) and join the decode batch."""
        assert self.prefilling is job
        cache, route = self.cache, job.route
        if job.blocks:
            parent: Block | bytes = route.scope_digest
            for i in range(len(route.keys)):
                if i >= job.num_hit_blocks:
                    job.blocks[i] = cache.insert(job.blocks[i], route.keys[i], route.token_ids[i : i + 1], parent)
                parent = job.blocks[i]
        self.prefilling = None
        job.done_at = self.clock.now + self.cost.decode_seconds(job.request.output_length)
        self.num_decoding += 1
        self.decode_done_sum += job.done_at
        self.busy_seconds += job.prefill_seconds + self.cost.decode_work_seconds(job.request.output_length)

    def finish(self, job: Job) -> None:
        self.cache.release(job.blocks)
        job.blocks = []
        self.num_decoding -= 1
        self.decode_done_sum = self.decode_done_sum - job.done_at if self.num_decoding else 0.0
