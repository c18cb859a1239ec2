"""Replay a trace over a fleet in steps, whole (`both` replicas) or disaggregated (prefill + decode pools).

    arrival ─policy─> prefill replica: queue, read what the shared tier has, compute the rest,
                      write the computed blocks to the shared tier (streamed as chunks finish: what is
                      left after the last chunk is on the request's path)
            ─policy─> decode replica (the one holding most of the prefix, as kv_aware prices it): queue,
                      read what its pool lacks from the shared tier, compute the tail, decode

With `both` replicas the first arrow is the whole story. Both fleets run the same step-level replica
(steps.py), the same cost model, the same shared tier and the same policy, so the comparison at
equal hardware is the roles alone. Every request leaves a `RequestTrail`: the seed's questions
(which worker had the prefix, how many bytes moved, what reuse saved, how long it queued where).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from tqdm import tqdm

from ..router.policies import RouteRequest
from ..router.policy_registry import make_policy
from ..traces.mooncake import Trace
from .replay import SimulationConfig, _percentile, json_ready, prepare_routes
from .replica import SimulationClock
from .steps import StepJob, StepReplica, last_block_tokens


def fleet_roles(num_prefill: int, num_decode: int) -> list[str]:
    """P prefill + D decode replicas; 0:N (or N:0) is N whole replicas."""
    if num_prefill < 0 or num_decode < 0 or num_prefill + num_decode < 1:
        raise ValueError(f"a fleet needs replicas: got {num_prefill} prefill and {num_decode} decode")
    if not num_prefill or not num_decode:
        return ["both"] * (num_prefill + num_decode)
    return ["prefill"] * num_prefill + ["decode"] * num_decode


def parse_pd(text: str) -> tuple[int, int]:
    """`--pd P:D`, e.g. 3:5."""
    try:
        prefill, decode = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--pd takes PREFILL:DECODE replica counts, e.g. 3:5; got {text!r}") from None
    if prefill < 1 or decode < 1:
        raise ValueError(f"--pd needs at least one prefill and one decode replica, got {text!r}")
    return prefill, decode


@dataclass
class RequestTrail:
    """One request through the fleet (times in simulated seconds, bytes of KV)."""

    arrival: float
    prompt_blocks: int  # full blocks of the prompt (trace blocks)
    prefill_replica: str = ""
    prefill_hit_blocks: int = 0  # in the prefill replica's pool
    prefill_fetched_blocks: int = 0  # read from the tiers below it (the shared tier) before computing
    prefill_fetched_bytes: int = 0
    prefill_wait: float = 0.0  # queued for the prefill slot
    computed_tokens: int = 0  # prompt tokens computed, on either replica
    written_bytes: int = 0  # computed blocks written to the shared tier for the decode replica
    handoff_seconds: float = 0.0  # what of that write outlasts the computation
    handed_over_at: float = math.nan  # when the decode replica was chosen
    handed_tokens: int = 0  # leading prompt tokens whose KV the shared tier holds for the decode replica
    decode_replica: str = ""
    decode_hit_blocks: int = 0  # already in the decode replica's pool: not moved
    decode_fetched_blocks: int = 0  # read from the shared tier: the blocks it lacked
    decode_fetched_bytes: int = 0
    decode_wait: float = 0.0  # queued on the decode replica (its prefill slot), after the hand-off
    ttft: float = math.nan
    tpot: float = math.nan  # mean time between output tokens after the first; NaN for one-token answers
    saved_seconds: float = 0.0  # prefill seconds the cache saved: the whole prompt's minus what was computed

    @property
    def moved_bytes(self) -> int:
        """KV moved for this request: read before the prefill, written for the hand-off, read by the decode side."""
        return self.prefill_fetched_bytes + self.written_bytes + self.decode_fetched_bytes


@dataclass
class StepResult:
    name: str  # "both x8", "pd 3:5"
    trails: list[RequestTrail] = field(default_factory=list)
    num_input_tokens: int = 0

    def _values(self, attribute: str) -> list[float]:
        return [value for trail in self.trails if not math.isnan(value := getattr(trail, attribute))]

    def percentile(self, attribute: str, q: float) -> float:
        return _percentile(self._values(attribute), q)

    @property
    def hit_rate(self) -> float:
        computed = sum(trail.computed_tokens for trail in self.trails)
        return 1 - computed / self.num_input_tokens if self.num_input_tokens else 0.0

    @property
    def moved_bytes_per_request(self) -> float:
        return sum(trail.moved_bytes for trail in self.trails) / max(len(self.trails), 1)

    def metrics(self) -> dict[str, Optional[float]]:
        values = {
            "num_requests": len(self.trails),
            "hit_rate": self.hit_rate,
            **{
                f"{name}_p{q}_s": self.percentile(name, q)
                for name in ("ttft", "tpot", "prefill_wait", "decode_wait")
                for q in (50, 99)
            },
            "moved_bytes_per_request": self.moved_bytes_per_request,
            "saved_prefill_seconds": sum(trail.saved_seconds for trail in self.trails),
        }
        return json_ready(values)


_STEP, _HANDOFF = 0, 1


def simulate_steps(
    trace: Trace,
    policy: str,
    config: SimulationConfig,
    roles: Sequence[str],
    routes: Optional[Sequence[RouteRequest]] = None,
    name: str = "",
    local_prefill_tokens: int = 0,
    max_prefill_queue: float = math.inf,
) -> StepResult:
    """Replay `trace` over replicas of these roles (fleet_roles), each step-level; a split fleet needs the
    shared tier (config.remote_blocks) its replicas hand prompts over through. In a split fleet a prompt of
    which the chosen decode replica lacks at most `local_prefill_tokens` is prefilled there, not handed over
    (conditional disaggregation, as Dynamo's max local prefill length); 0 hands every prompt over. So is every
    prompt while the least queued prefill replica has more than `max_prefill_queue` seconds of prefill queued
    (as Dynamo's max prefill queue size): a backed-up prefill pool is not worth waiting for."""
    if local_prefill_tokens < 0:
        raise ValueError(f"local_prefill_tokens (--pd-local-prefill) must be 0 or more, got {local_prefill_tokens}")
    if not max_prefill_queue >= 0:
        raise ValueError(
            f"max_prefill_queue (--pd-max-prefill-queue) must be 0 or more seconds, got {max_prefill_queue}"
        )
    split = "prefill" in roles
    if split and not config.remote_blocks:
        raise ValueError(
            "prefill and decode replicas hand prompts over through the shared tier: give it a size (--remote-blocks)"
        )
    if split != ("decode" in roles) or "both" in roles and split:
        raise ValueError(f"a fleet is whole (both) or split (prefill and decode), got roles {list(roles)}")
    routes = prepare_routes(trace) if routes is None else routes
    replay = _StepReplay(trace, config, roles, policy)
    progress = tqdm(
        total=len(trace.requests),
        desc=name or policy,
        unit="req",
        leave=False,
        disable=None if config.progress else True,
    )
    for request, route in zip(trace.requests, routes):
        replay.run_events(request.arrival_time)
        replay.clock.now = request.arrival_time
        trail = RequestTrail(request.arrival_time, len(route.keys))
        replica = None
        if split and (local_prefill_tokens or max_prefill_queue < math.inf):
            decode = replay.back[replay.back_policy.choose(route, replay.back)]
            lacking = request.input_length - decode.num_hit_blocks(route) * trace.block_size
            if lacking <= local_prefill_tokens or min(r.queue_seconds for r in replay.front) > max_prefill_queue:
                trail.handed_over_at = request.arrival_time  # no hand-off: the decode replica's queue is the wait
                trail.prefill_replica = decode.name
                replay.trails.append(trail)
                replica = decode
        if replica is None:
            replica = replay.front[replay.front_policy.choose(route, replay.front)]
        replay.admit(replica, request, route, trail)
        progress.update()
    progress.close()
    replay.run_events(math.inf)
    replay.check(config.check_integrity)
    return StepResult(
        name or (f"pd {roles.count('prefill')}:{roles.count('decode')}" if split else f"both x{len(roles)}"),
        replay.trails,
        trace.num_input_tokens,
    )


class _StepReplay:
    def __init__(self, trace: Trace, config: SimulationConfig, roles: Sequence[str], policy: str) -> None:
        self.config, self.clock, self.block_size = config, SimulationClock(), trace.block_size
        tiers = config.tier_factory()
        self.replicas = [
            StepReplica(
                i,
                config.capacity_blocks,
                config.cost,
                trace.block_size,
                self.clock,
                tiers(),
                config.fetch_policy,
                role=role,
            )
            for i, role in enumerate(roles)
        ]
        self.front = [r for r in self.replicas if r.role != "decode"]
        self.back = [r for r in self.replicas if r.role == "decode"]
        options = config.options_for()
        self.front_policy, self.back_policy = make_policy(policy, options), make_policy(policy, options)
        self.remote_cost = config.cost.tier_costs()["remote"]
        self.events: list[tuple] = []
        self.sequence = itertools.count()
        self.trails: list[RequestTrail] = []

    def admit(self, replica: StepReplica, request, route, trail: RequestTrail) -> None:
        replica.advance(self.clock.now)
        job = replica.enqueue(request, route)
        job.trail, job.handed_tokens = trail, trail.handed_tokens
        if replica.role != "prefill":
            trail.decode_replica = replica.name
        if replica.role != "decode":
            trail.prefill_replica = replica.name
            self.trails.append(trail)
        self._start(replica)

    def _start(self, replica: StepReplica) -> None:
        """Begin the next prefill if the slot is free, then reschedule the replica's next event."""
        if replica.prefilling is None:
            job = replica.begin_prefill()
            if job is not None:
                trail, now = job.trail, self.clock.now
                if replica.role == "decode":
                    trail.decode_wait = now - trail.handed_over_at
                    trail.decode_hit_blocks = job.num_hit_blocks
                    trail.decode_fetched_blocks = job.fetch.num_fetch_blocks
                    trail.decode_fetched_bytes = job.fetch.num_fetch_blocks * replica.block_bytes + int(
                        job.extra_tokens * replica.cost.kv_bytes_per_token
                    )
                else:
                    trail.prefill_wait = now - trail.arrival
                    trail.prefill_hit_blocks = job.num_hit_blocks
                    trail.prefill_fetched_blocks = job.fetch.num_fetch_blocks
                    trail.prefill_fetched_bytes = job.fetch.num_fetch_blocks * replica.block_bytes
        replica.version += 1
        when = replica.next_event()
        if when < math.inf:
            heapq.heappush(self.events, (when, next(self.sequence), _STEP, replica, replica.version))

    def run_events(self, until: float) -> None:
        events = self.events
        while events and events[0][0] <= until:
            self.clock.now, _, kind, subject, version = heapq.heappop(events)
            if kind == _HANDOFF:
                job: StepJob = subject
                job.trail.handed_over_at = self.clock.now
                self.admit(self.back[self.back_policy.choose(job.route, self.back)], job.request, job.route, job.trail)
                continue
            replica: StepReplica = subject
            if version != replica.version:
                continue  # its rates changed after this was scheduled
            replica.advance(self.clock.now)
            done = replica.prefill_done()
            if done is not None:
                self._prefilled(replica, done)
            for job in replica.finished():
                self._decoded(job)
            self._start(replica)

    def _prefilled(self, replica: StepReplica, job: StepJob) -> None:
        trail, request, cost, now = job.trail, job.request, self.config.cost, self.clock.now
        cached = min((job.num_hit_blocks + job.fetch.num_fetch_blocks) * self.block_size, request.input_length)
        trail.computed_tokens += request.input_length - cached - job.extra_tokens
        if trail.prefill_replica == replica.name:  # what earlier requests' blocks saved (not the hand-off's reads)
            trail.saved_seconds = cost.prefill_seconds(request.input_length, 0) - cost.prefill_seconds(
                request.input_length, cached
            )
        if replica.role == "prefill":
            # every engine block computed here is written (none if the pool could not hold the prompt)
            trail.handed_tokens = request.input_length - last_block_tokens(request.input_length) if job.blocks else 0
            num_written = max(trail.handed_tokens - cached, 0)
            replica.hand_off(job)
            trail.written_bytes = int(num_written * cost.kv_bytes_per_token)
            compute_seconds = job.prefill_seconds - job.fetch.fetch_seconds
            last_chunk = min(cost.prefill_chunk_tokens, num_written) * cost.kv_bytes_per_token
            trail.handoff_seconds = (
                max(
                    self.remote_cost.seconds(trail.written_bytes) - compute_seconds,
                    self.remote_cost.seconds(last_chunk),
                )
                if num_written
                else 0.0
            )
            heapq.heappush(self.events, (now + trail.handoff_seconds, next(self.sequence), _HANDOFF, job, 0))
            return
        trail.ttft = now - trail.arrival
        replica.join_batch(job)  # a one-token answer is done: its TPOT stays NaN

    def _decoded(self, job: StepJob) -> None:
        num_tokens = job.request.output_length - 1
        job.trail.tpot = (self.clock.now - job.first_token_at) / num_tokens

    def check(self, integrity: bool) -> None:
        for replica in self.replicas:
            assert replica.prefilling is None and not replica.batch and not replica.queue, f"{replica.name} unfinished"
            if integrity:
                replica.check_integrity()


def trails_to_rows(result: StepResult) -> list[dict]:
    """One JSON-ready dict a request, in arrival order (NaN as None)."""
    return [
        json_ready({**asdict(trail), "moved_bytes": trail.moved_bytes})
        for trail in sorted(result.trails, key=lambda trail: trail.arrival)
    ]
