"""The KV hierarchy under the device pool, as the engine drives it: host RAM, local disk, the fleet's remote.

    device pool ──LRU eviction──> host tier          (on eviction: a cold block's KV is copied out
         │                                            before its slot is reused)
         └──every block computed──> disk tier        (write-through, on a background thread: a restart
                                                      finds what was computed seconds before)

    a waiting request: device match ─> the tiers' run ─> fetch or recompute   (tier_reads.py)

Tiers are driven by what they declare (KVTier.traits: synchronous, write-through, shared), never
by their names. Fetched blocks are promoted into the device radix as ordinary cached blocks, so
admission then matches them like any device hit; a block brought back is not written back to
where it came from, nor to a shared tier.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..cache import Block, BlockKeyer, RadixCache
from ..cache.events import BlockRemoved, BlockStored
from ..cache.keys import unpack_tokens
from ..cache.stats import LatencyHistogram
from ..tiers import BlockRecord, KVTier, TierStats
from ..tiers.record import DTYPE_SIZES
from .request import Request
from .runner import ModelRunner
from .tier_reads import TierFetch, TierReads

FETCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 2e-4  # until the engine has measured its own prefill
DEFAULT_TIER_DEADLINE = 0.5  # EngineConfig.kv_tier_deadline


@dataclass(frozen=True)
class TierSnapshot:
    stats: TierStats
    used_bytes: int
    capacity_bytes: int
    hit_tokens: int
    fetch_buckets: list[tuple[str, int]]
    fetch_seconds_sum: float
    rejections: dict[str, int] = field(default_factory=dict)  # by reason


class TieredKV(TierReads):
    """The tiers below one engine's pool: what is written down (here) and read back (TierReads, tier_reads.py)."""

    def __init__(
        self,
        tiers: Sequence[KVTier],
        runner: ModelRunner,
        cache: RadixCache,
        keyer: BlockKeyer,
        scope_digest: bytes,
        fetch_policy: str = "cost",
        deadline: float = DEFAULT_TIER_DEADLINE,
        shared_writes_wait: bool = False,
    ) -> None:
        self.tiers = {tier.name: tier for tier in tiers}
        self.deadline = deadline  # seconds a request waits for a tier read before it recomputes
        self.stalled: dict[str, concurrent.futures.Future] = {}  # tier -> a read given up on, still running
        self.fetch_policy = fetch_policy  # EngineConfig.kv_fetch_policy
        # A prefill replica (EngineConfig.role): the shared tier's writes end before the step does, so a request's
        # KV is there before its answer leaves, for the decode replica the router sends it to next.
        self.shared_writes_wait = shared_writes_wait
        self.runner, self.cache, self.keyer = runner, cache, keyer
        self.block_size = cache.block_size
        self.scope_digest = scope_digest  # the model's unsalted scope: records of another model never load
        self.shape, self.dtype = runner.block_shape, runner.dtype_name
        self.block_bytes = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        self.prefill_seconds_per_token = DEFAULT_PREFILL_SECONDS_PER_TOKEN
        self.hit_tokens: dict[str, int] = {name: 0 for name in self.tiers}
        self.fetch_latency = {name: LatencyHistogram(FETCH_BUCKETS) for name in self.tiers}
        self.fetches: dict[str, TierFetch] = {}  # request id -> its lookup
        self._written: list[tuple[Block, Optional[str]]] = []  # (block just cached, tier it came from)
        self._promoting_from: Optional[str] = None
        # Tiers every computed block is written to, in the background (disk: durability, remote: the fleet),
        # and those that keep what the pool evicts (host).
        self.write_tiers = [tier for tier in tiers if tier.traits.write_through]
        self.spill_tiers = [tier for tier in tiers if not tier.traits.write_through]
        if self.spill_tiers:
            cache.on_evict = self._spill
        if cache.events is not None:  # KV events carry each local tier's medium, so a router can mirror them
            for tier in tiers:
                if tier.traits.event_medium is not None:
                    self._publish_tier_events(tier, tier.traits.event_medium, cache.events)
        if self.write_tiers:
            cache.on_insert = self._note_written

    # ------------------------------------------------------------------ writing down
    def _record(self, block: Block, payload: bytes) -> BlockRecord:
        parent = block.parent
        return BlockRecord(
            key=block.key,
            parent_key=parent.key if isinstance(parent, Block) else None,
            scope_digest=self.scope_digest,
            token_ids=tuple(unpack_tokens(block.token_bytes)),
            dtype=self.dtype,
            shape=self.shape,
            payload=payload,
            tenant_scope=block.scope or b"",
        )

    def _spill(self, block: Block) -> None:
        """A cold block leaves the pool: keep its KV in host RAM (its slot is still intact), unless its
        request said its KV never leaves the device (cache_retention "device"), or its window layers' K/V is
        already gone (cache/window_slots.py: a record holds every layer)."""
        if block.device_only or not self.runner.holds_every_layer(block.block_id):
            return
        record = self._record(block, self.runner.read_blocks([block.block_id])[0])
        for tier in self.spill_tiers:
            tier.put([record])

    def _publish_tier_events(self, tier: KVTier, medium: str, events) -> None:
        block_size = self.block_size
        tier.watch(
            lambda key: events.publish(BlockStored([key], None, [], block_size, medium)),
            lambda key: events.publish(BlockRemoved([key], medium)),
        )

    def __getitem__(self, name: str) -> KVTier:
        return self.tiers[name]

    @property
    def shared(self) -> Optional[KVTier]:
        """The fleet's shared tier, if this replica has one."""
        return next((tier for tier in self.tiers.values() if tier.traits.shared), None)

    def rescope(self, scope_digest: bytes) -> dict[str, int]:
        """A hot reload made `scope_digest` the model's scope (call with no request in flight): this
        replica's own tiers delete the old scope's records, which could never load again (returns how
        many per tier); a shared tier switches to the new scope's keys and leaves the old ones to
        replicas still serving that version."""
        self.scope_digest = scope_digest
        self.fetches.clear()
        self._written.clear()
        reclaimed: dict[str, int] = {}
        for name, tier in self.tiers.items():
            tier.flush()  # a queued write of the old scope must not land after the purge
            count = tier.rescope(scope_digest)
            if count is not None:
                reclaimed[name] = count
        return reclaimed

    def tier_keys(self) -> dict[str, list[bytes]]:
        """Every key each published tier holds, by KV-event medium (for a router's snapshot)."""
        return {
            tier.traits.event_medium: tier.keys()
            for tier in self.tiers.values()
            if tier.traits.event_medium is not None
        }

    def _note_written(self, block: Block) -> None:
        if not block.device_only:
            self._written.append((block, self._promoting_from))

    def write_through(self) -> None:
        """Blocks cached this step go to the write-through tiers in the background (their KV is written now).

        A block computed here goes to every one; a block brought back from a tier is not written back to it,
        nor to a shared tier (the fleet had it, or our own tiers wrote it when it was computed).
        """
        if not self._written:
            return
        written, self._written = self._written, []
        payloads: dict[int, bytes] = {}
        for tier in self.write_tiers:
            blocks = [
                block
                for block, source in written
                if block.key is not None
                and source != tier.name
                and not (source is not None and tier.traits.shared)
                and self.runner.holds_every_layer(block.block_id)
            ]
            if not tier.traits.shared:  # already there: a look-up in this replica's own index
                blocks = [block for block in blocks if not tier.contains([block.key])]
            missing = [block.block_id for block in blocks if block.block_id not in payloads]
            if missing:
                payloads.update(zip(missing, self.runner.read_blocks(missing)))
            if blocks:
                records = [self._record(block, payloads[block.block_id]) for block in blocks]
                if self.shared_writes_wait and tier.traits.shared:
                    tier.put(records)
                else:
                    tier.put_async(records)

    # ------------------------------------------------------------------ bookkeeping
    def observe_step(self, scheduled, seconds: float) -> None:
        """Learn this engine's prefill cost from steps that were mostly prefill (the planner's other side)."""
        num_tokens = sum(num_new for _, num_new in scheduled)
        if num_tokens >= 64 * len(scheduled):
            per_token = seconds / num_tokens
            self.prefill_seconds_per_token += 0.2 * (per_token - self.prefill_seconds_per_token)

    def tokens_by_tier(self, request: Request) -> dict[str, int]:
        """{"device", "host", "disk", "remote"} tokens of the request's cached prefix (num_cached_tokens is
        their sum)."""
        cached = max(request.num_cached_tokens, 0)
        fetch = self.fetches.get(request.request_id)
        counts = empty_breakdown(cached)
        if fetch is not None:
            for name in self.tiers:  # nearest first
                tokens = min(fetch.num_blocks.get(name, 0) * self.block_size, counts["device"])
                counts[name] = tokens
                counts["device"] -= tokens
        return counts

    def snapshot(self) -> dict[str, "TierSnapshot"]:
        """Per tier: counters, usage, hit tokens and fetch latencies, for metrics (engine thread)."""
        return {
            name: TierSnapshot(
                stats=tier.stats,
                used_bytes=tier.used_bytes,
                capacity_bytes=tier.capacity_bytes,
                hit_tokens=self.hit_tokens[name],
                fetch_buckets=self.fetch_latency[name].cumulative(),
                fetch_seconds_sum=self.fetch_latency[name].total,
                rejections=tier.rejections,
            )
            for name, tier in self.tiers.items()
        }

    def forget(self, request_id: str) -> None:
        fetch = self.fetches.pop(request_id, None)
        if fetch is not None and fetch.pending is not None:
            fetch.pending.cancel()

    def close(self) -> None:
        """Flush what is queued for disk and stop the tiers' threads (a clean shutdown)."""
        for tier in self.tiers.values():
            tier.close()


def empty_breakdown(num_cached_tokens: int) -> dict[str, int]:
    """All cached tokens from the device pool (no tiers, or none of them used)."""
    return {"device": num_cached_tokens, "host": 0, "disk": 0, "remote": 0}
