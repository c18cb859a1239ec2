"""Reading KV back from the tiers below one engine's pool into it, for requests admission considers.

    a waiting request: device match ─> host run ─> disk run ─> remote run ─> fetch or recompute
                       (tiers/policy.py: find_run, then choose_fetch under kv_fetch_policy)
    asked by admission through engine/prefix_sources.py: `find` the run and the planner's choice, `load` it
        a synchronous tier (host): read now, copied into fresh pool blocks and cached there
        the others (disk, remote): read on their threads; the request waits (not the engine), then the same

Every record read is verified (key, scope, tokens, dtype, shape, checksum or seal, finite values)
before its bytes reach the pool; a bad one is deleted, counted and recomputed, never used. A read
that takes longer than the tier deadline is given up: the request recomputes, the tier is counted
slow, and it is not asked again until that read has returned.

TierReader owns the lookups in flight and the read counters; what it shares with the writer (the
tiers, the pool, the keyer, the scope, the measured prefill cost) is their TierContext.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..cache.stats import LatencyHistogram
from ..tiers import RecordError, RecordExpectation, choose_fetch, decode_record, find_run
from .device import TORCH_DTYPES
from .prefix_sources import SourceRun
from .request import Request, RequestStatus
from .tier_context import TierContext
from .tier_writer import TierWriter

logger = logging.getLogger("prefixserve")
FETCH_WAIT_SECONDS = 0.005  # an idle engine waits this long for a disk read before stepping again
FETCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
DEFAULT_TIER_DEADLINE = 0.5  # EngineConfig.kv_tier_deadline


@dataclass
class TierFetch:
    """A request's lower-tier lookup: where its run continues and what was read back."""

    request: Request
    start: int  # first block index the tiers serve (after the device hit)
    num_blocks: dict[str, int] = field(default_factory=dict)  # promoted blocks per tier
    pending: Optional[concurrent.futures.Future] = None  # a disk read in flight
    pending_keys: list[bytes] = field(default_factory=list)
    pending_start: int = 0
    pending_tier: str = ""
    pending_since: float = 0.0


class TierReader:
    """Looks waiting requests up below the pool and promotes what it reads into the pool."""

    def __init__(
        self,
        context: TierContext,
        writer: TierWriter,
        fetch_policy: str = "cost",
        deadline: float = DEFAULT_TIER_DEADLINE,
    ) -> None:
        self.context = context
        self.writer = writer  # told where promoted blocks came from, so they are not written back there
        self.fetch_policy = fetch_policy  # EngineConfig.kv_fetch_policy
        self.deadline = deadline  # seconds a request waits for a tier read before it recomputes
        self.stalled: dict[str, concurrent.futures.Future] = {}  # tier -> a read given up on, still running
        self.fetches: dict[str, TierFetch] = {}  # request id -> its lookup
        self.hit_tokens: dict[str, int] = {name: 0 for name in context.tiers}
        self.fetch_latency = {name: LatencyHistogram(FETCH_BUCKETS) for name in context.tiers}

    def find(self, request: Request, keys: Sequence[bytes], start: int) -> tuple[list[SourceRun], float, float]:
        """The run of keys[start:] through the tiers (nearest first; a stalled tier and what lies past it are out)
        and what the planner reads of it: (runs, estimated fetch seconds, estimated recompute seconds). A request
        is looked up once: asked again, it finds nothing."""
        context = self.context
        if not context.tiers or request.request_id in self.fetches:
            return [], 0.0, 0.0
        self.fetches[request.request_id] = TierFetch(request, start=start)
        available = []
        for name, tier in context.tiers.items():
            if self._is_stalled(name):
                break  # a read given up on has not returned: this tier (and the run past it) is out for now
            available.append(tier)
        held = find_run(available, keys, start)
        if not held:
            return [], 0.0, 0.0
        plan = choose_fetch(
            self.fetch_policy,
            held,
            context.block_bytes,
            context.prefill_seconds_per_token,
            context.block_size,
            {tier.name: tier.read_cost for tier in available},
        )
        runs = [SourceRun(name, count, plan.num_fetch_blocks_by_tier.get(name, 0)) for name, count in held]
        return runs, plan.fetch_seconds, plan.recompute_seconds

    def load(self, request: Request, keys: Sequence[bytes], start: int, runs: Sequence[SourceRun]) -> None:
        """Read back what `find` chose, nearest tier first: a synchronous tier's blocks into the pool now; an
        asynchronous tier's read starts and the request waits (RequestStatus.WAITING_FOR_KV) until `collect`."""
        context = self.context
        for run in runs:
            if not run.num_chosen:
                return  # the planner stops here: what follows is recomputed
            chunk = keys[start : start + run.num_chosen]
            tier = context.tiers[run.source]
            if not tier.traits.synchronous:
                fetch = self.fetches[request.request_id]
                fetch.pending, fetch.pending_keys, fetch.pending_start = tier.fetch(chunk), chunk, start
                fetch.pending_tier, fetch.pending_since = run.source, time.perf_counter()
                request.status = RequestStatus.WAITING_FOR_KV
                return
            promoted = self._promote(request, run.source, start, chunk, tier.get(chunk), time.perf_counter())
            start += promoted
            if promoted < run.num_chosen:
                return

    def _is_stalled(self, name: str) -> bool:
        future = self.stalled.get(name)
        if future is not None and future.done():
            del self.stalled[name]
            future = None
        return future is not None

    def collect(self) -> None:
        """Promote what finished disk reads brought back; their requests may be admitted again. A read
        past the deadline is given up on: its request recomputes."""
        now = time.perf_counter()
        for fetch in list(self.fetches.values()):
            if fetch.pending is None:
                continue
            if not fetch.pending.done():
                if now - fetch.pending_since > self.deadline:
                    self._give_up(fetch)
                continue
            future, fetch.pending = fetch.pending, None
            self._done_waiting(fetch.request)
            try:
                encoded = future.result()
            except Exception:  # a tier's bug: recompute
                logger.exception("reading from the %s tier failed; recomputing", fetch.pending_tier)
                continue
            if not fetch.request.is_finished:
                self._promote(
                    fetch.request,
                    fetch.pending_tier,
                    fetch.pending_start,
                    fetch.pending_keys,
                    encoded,
                    fetch.pending_since,
                )

    def _give_up(self, fetch: TierFetch) -> None:
        tier = self.context.tiers[fetch.pending_tier]
        self.stalled[fetch.pending_tier] = fetch.pending
        fetch.pending.cancel()  # still queued: never runs; running: its result is dropped
        fetch.pending = None
        self._done_waiting(fetch.request)
        tier.count_slow_read(self.deadline)

    @staticmethod
    def _done_waiting(request: Request) -> None:
        """Its read came back or was given up on: the request may be admitted (unless it finished meanwhile)."""
        if request.status is RequestStatus.WAITING_FOR_KV:
            request.status = RequestStatus.WAITING

    def wait_for_reads(self) -> None:
        """Nothing could be scheduled: wait briefly for a disk read instead of spinning."""
        pending = [fetch.pending for fetch in self.fetches.values() if fetch.pending is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=FETCH_WAIT_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def has_pending_reads(self) -> bool:
        return any(fetch.pending is not None for fetch in self.fetches.values())

    def forget(self, request_id: str) -> None:
        """A request finished: drop its lookup (a read still queued for it never runs)."""
        fetch = self.fetches.pop(request_id, None)
        if fetch is not None and fetch.pending is not None:
            fetch.pending.cancel()

    def _promote(
        self,
        request: Request,
        tier_name: str,
        start: int,
        keys: list[bytes],
        encoded: Sequence[Optional[bytes]],
        began: float,
    ) -> int:
        """Verify records for blocks start.. and cache their KV in fresh pool blocks; returns how many.

        Nothing happens (0) unless the request's first `start` blocks are cached on the device now: a
        promoted block must hang from its parent.
        """
        context = self.context
        cache, tier, size = context.cache, context.tiers[tier_name], context.block_size
        prefix = cache.match(
            request.scope_digest, request.block_keys[:start], request.token_ids, record_stats=False
        ).blocks
        if len(prefix) != start:
            return 0
        payloads = []
        for offset, (key, data) in enumerate(zip(keys, encoded)):
            if data is None:
                break
            index = start + offset
            expect = RecordExpectation(
                key=key,
                scope_digest=context.scope_digest,
                token_ids=tuple(request.token_ids[index * size : (index + 1) * size]),
                dtype=context.dtype,
                shape=context.shape,
                tenant_scope=request.block_scope(index),
            )
            try:
                payload = decode_record(data, expect, tier.sealer).payload
                if not payload_is_finite(payload, context.dtype):
                    raise RecordError("nonfinite", "the KV holds NaN or infinity")
            except RecordError as error:
                tier.reject(key, error.reason)
                break
            payloads.append(payload)
        if not payloads:
            return 0
        # Admitting holds the device prefix while allocating, so eviction cannot break the chain under us.
        blocks = cache.admit(prefix, len(payloads), requester=request.owner)
        if blocks is None:
            return 0  # the pool is held by running requests: recompute
        fresh = blocks[start:]
        context.runner.write_blocks([block.block_id for block in fresh], payloads)
        parent = prefix[-1] if prefix else request.scope_digest
        with self.writer.promoting(tier_name):
            for offset, block in enumerate(fresh):
                index = start + offset
                cached = cache.insert(
                    block,
                    keys[offset],
                    request.token_ids[index * size : (index + 1) * size],
                    parent,
                    scope=request.block_scope(index),
                    owner=request.block_owner(index),
                    lora=request.lora_label,
                )
                blocks[start + offset] = cached
                parent = cached
        cache.release(blocks)
        fetch = self.fetches.get(request.request_id)
        if fetch is not None:
            fetch.num_blocks[tier_name] = fetch.num_blocks.get(tier_name, 0) + len(payloads)
        self.hit_tokens[tier_name] += len(payloads) * size
        self.fetch_latency[tier_name].observe(time.perf_counter() - began)
        return len(payloads)


def payload_is_finite(payload: bytes, dtype: str) -> bool:
    """No NaN or infinity in a record's KV: its minimum and maximum in one pass (a NaN propagates into
    both, an infinity is one of them). 3.5 ms for a 2,000-token SmolLM2 prefix (92 MB) here, where
    isfinite().all() took 25 ms building a mask first."""
    if not payload:
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: only read here
        values = torch.frombuffer(payload, dtype=TORCH_DTYPES[dtype])
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))
