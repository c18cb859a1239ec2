"""A simulated replica whose decode runs in steps that prefill slows down: the replica of `simulate --pd`.

The policy replay (replica.py) lets decoding overlap prefill for free. Here a decode step costs

    step = decode_seconds_per_token + KV of the running sequences / decode_bytes_per_second

and, while a prefill is computing on the same replica, every step also carries a chunk of it
(chunked prefill): the step takes prefill_chunk_tokens x prefill_seconds_per_token longer (or the whole
prefill's computation, if shorter) and the prefill advances by that chunk. So prefill and decode slow each
other on a `both` replica, which is what disaggregation removes:

    role "both"     prefill here, then decode here (the first token comes from the prefill)
    role "prefill"  prefill, write the computed blocks to the shared tier, decode nothing
    role "decode"   read what the pool lacks from the shared tier, compute the rest (at least the
                    last token), decode

Rates change only at events (a prefill starts, a fetch ends, a sequence joins or leaves the batch),
so progress is integrated between events: a prefill in seconds of computation, the batch in tokens
per sequence (every sequence of a batch advances one token a step: one virtual token clock, and a
heap of the clock values at which each sequence is done).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Optional

from ..router.policies import RouteRequest
from ..traces.mooncake import TraceRequest
from .replica import Job, SimulatedReplica

ROLES = ("both", "prefill", "decode")
# The engine's own block (EngineConfig.block_size): a trace block of 512 tokens is 32 of them. Between a prefill
# and a decode replica every engine block of the prompt moves, not only whole trace blocks; the decode replica
# computes the engine block holding the last token.
ENGINE_BLOCK_TOKENS = 16
_EPSILON = 1e-9


def last_block_tokens(num_prompt_tokens: int) -> int:
    """Tokens of the engine block that holds the prompt's last token: what a replica always computes."""
    return (num_prompt_tokens - 1) % ENGINE_BLOCK_TOKENS + 1


class StepJob(Job):
    """A job with its progress: fetch and computation left, and when its sequence is done decoding."""

    __slots__ = (
        "fetch_left",
        "compute_left",
        "chunk_seconds",
        "done_tokens",
        "first_token_at",
        "context_tokens",
        "trail",
        "handed_tokens",
        "extra_tokens",
    )

    def __init__(self, request: TraceRequest, route: RouteRequest, prefill_estimate: float, estimate: float) -> None:
        super().__init__(request, route, prefill_estimate, estimate)
        self.fetch_left = self.compute_left = 0.0
        self.chunk_seconds = 0.0  # computation one step carries: a chunk, or the whole prefill if it is shorter
        self.done_tokens = 0.0  # the replica's token clock value at which this sequence has its last token
        self.first_token_at = math.nan
        self.context_tokens = 0.0
        self.trail: Optional[object] = None  # the replay's record of the request (simulate_pd.RequestTrail)
        self.handed_tokens = 0  # decode role: leading prompt tokens whose KV a prefill replica left in the shared tier
        self.extra_tokens = 0  # of those, read past the whole trace blocks (the engine blocks of the last trace block)


class StepReplica(SimulatedReplica):
    """One replica of a step-level replay: the policy replay's cache, queue and tiers, with decode steps."""

    job_type = StepJob

    def __init__(self, *args, role: str = "both", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.name = f"{role}-{self.name.removeprefix('replica-')}"
        self.token_clock = 0.0  # tokens each sequence that has decoded since the start would have by now
        self.batch: list[tuple[float, int, StepJob]] = []  # (done_tokens, order, job): the decoding sequences
        self.batch_context = 0.0  # KV tokens the decoding sequences hold (each counted at its mean length)
        self.updated_at = 0.0
        self.version = 0  # bumped at every change of rates: events scheduled before it are stale
        self._order = itertools.count()

    # ------------------------------------------------------------------ rates
    def _rates(self) -> tuple[float, float]:
        """(prefill progress per second, tokens per sequence per second) until the next event."""
        cost, job = self.cost, self.prefilling
        step = cost.decode_step_seconds(self.batch_context) if self.batch else 0.0
        computing = job is not None and job.fetch_left <= _EPSILON and job.compute_left > _EPSILON
        if computing and self.batch:
            chunk = job.chunk_seconds
            return chunk / (step + chunk), 1.0 / (step + chunk)
        return 1.0, (1.0 / step if self.batch else 0.0)  # a fetch, a lone prefill or a lone batch: full speed

    def advance(self, now: float) -> None:
        """Integrate progress from the last update to `now` (no event lies between them)."""
        elapsed = now - self.updated_at
        if elapsed <= 0:
            return
        prefill_rate, token_rate = self._rates()
        job = self.prefilling
        if job is not None:
            if job.fetch_left > _EPSILON:
                job.fetch_left = max(job.fetch_left - elapsed, 0.0)
            else:
                job.compute_left -= min(elapsed * prefill_rate, job.compute_left)
        self.token_clock += elapsed * token_rate
        self.updated_at = now

    def next_event(self) -> float:
        """When the running fetch, the running prefill or the next sequence ends at today's rates."""
        now, (prefill_rate, token_rate) = self.updated_at, self._rates()
        when = math.inf
        job = self.prefilling
        if job is not None:
            when = now + (job.fetch_left if job.fetch_left > _EPSILON else job.compute_left / prefill_rate)
        if self.batch and token_rate > 0:
            when = min(when, now + max(self.batch[0][0] - self.token_clock, 0.0) / token_rate)
        return when

    # ------------------------------------------------------------- life cycle
    def begin_prefill(self) -> Optional[StepJob]:
        """Admit the head of the queue if the prefill slot is free and its blocks can be had (else it waits for
        the batch to free some, as a scheduler's waiting queue does): its fetch first, then its computation."""
        if self.prefilling is not None or not self.queue:
            return None
        if self.batch and not self._fits(self.queue[0]):
            return None
        job = self.start_prefill()
        if job is None:
            return None
        job.fetch_left = job.fetch.fetch_seconds
        job.compute_left = job.prefill_seconds - job.fetch.fetch_seconds
        if self.role == "decode" and job.handed_tokens:  # the prefill replica wrote the prompt's engine blocks
            cost, request = self.cost, job.request
            cached = min((job.num_hit_blocks + job.fetch.num_fetch_blocks) * self.block_size, request.input_length)
            job.extra_tokens = min(
                request.input_length - cached - last_block_tokens(request.input_length), job.handed_tokens - cached
            )
            if job.extra_tokens > 0:
                job.fetch_left += job.extra_tokens * cost.kv_bytes_per_token / cost.remote_bytes_per_second
                job.compute_left = cost.prefill_seconds(request.input_length, cached + job.extra_tokens)
                job.prefill_seconds = job.fetch_left + job.compute_left
            else:
                job.extra_tokens = 0
        job.chunk_seconds = min(self.cost.prefill_chunk_tokens * self.cost.prefill_seconds_per_token, job.compute_left)
        return job  # type: ignore[return-value]

    def _fits(self, job: Job) -> bool:
        route, cache = job.route, self.cache
        hit = cache.match(route.scope_digest, route.keys, route.token_ids, record_stats=False).blocks
        return cache.can_admit(hit, self.num_blocks_needed(job.request) - len(hit))

    def prefill_done(self) -> Optional[StepJob]:
        job = self.prefilling
        if job is not None and job.fetch_left <= _EPSILON and job.compute_left <= _EPSILON:
            return job  # type: ignore[return-value]
        return None

    def hand_off(self, job: StepJob) -> None:
        """A prefill replica's prompt is computed: index its blocks (they stay cached here), hold none."""
        self.register_prompt(job)
        self.cache.release(job.blocks)
        job.blocks = []
        self.busy_seconds += job.prefill_seconds

    def join_batch(self, job: StepJob) -> None:
        """The prompt is in and its first token out: decode the rest here (a one-token answer is done)."""
        self.register_prompt(job)
        job.first_token_at = self.clock.now
        num_tokens = job.request.output_length - 1
        self.busy_seconds += job.prefill_seconds
        if num_tokens <= 0:
            self.cache.release(job.blocks)
            job.blocks = []
            return
        job.done_tokens = self.token_clock + num_tokens
        job.context_tokens = job.request.input_length + num_tokens / 2
        job.done_at = self.clock.now + self.cost.decode_seconds(num_tokens)  # the policies' load estimate
        heapq.heappush(self.batch, (job.done_tokens, next(self._order), job))
        self.batch_context += job.context_tokens
        self.num_decoding += 1
        self.decode_done_sum += job.done_at
        self.busy_seconds += self.cost.decode_work_seconds(num_tokens)

    def finished(self) -> list[StepJob]:
        """The sequences whose last token is out by now; they leave the batch and free their blocks."""
        done = []
        while self.batch and self.batch[0][0] <= self.token_clock + _EPSILON:
            job = heapq.heappop(self.batch)[2]
            self.batch_context = self.batch_context - job.context_tokens if self.batch else 0.0
            self.finish(job)
            done.append(job)
        return done
