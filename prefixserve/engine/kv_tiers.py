"""The KV hierarchy under one engine's pool, as the engine drives it: host RAM, local disk, the fleet's remote.

    device pool ──LRU eviction──> host tier          (tier_writer.py: spill and write-through)
         └──every block computed──> disk, remote
    a waiting request: device match ─> the tiers' run ─> fetch or recompute   (tier_reader.py)

Tiers are driven by what they declare (KVTier.traits: synchronous, write-through, shared), never
by their names. Fetched blocks are promoted into the device radix as ordinary cached blocks, so
admission then matches them like any device hit. A pool with no tiers below it has an empty
TieredKV: every call is answered, nothing is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..cache import BlockKeyer, RadixCache
from ..tiers import KVTier, TierStats
from .request import Request
from .runner import ModelRunner
from .tier_context import TierContext
from .tier_reader import DEFAULT_TIER_DEADLINE, TierReader
from .tier_writer import TierWriter


@dataclass(frozen=True)
class TierSnapshot:
    stats: TierStats
    used_bytes: int
    capacity_bytes: int
    hit_tokens: int
    fetch_buckets: list[tuple[str, int]]
    fetch_seconds_sum: float
    rejections: dict[str, int] = field(default_factory=dict)  # by reason


class TieredKV:
    """The tiers below one engine's pool: a reader and a writer over their shared context, and what the server
    asks of them (snapshots, keys, where a request's cached tokens came from)."""

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
        self.context = TierContext({tier.name: tier for tier in tiers}, runner, cache, keyer, scope_digest)
        self.writer = TierWriter(self.context, shared_writes_wait)
        self.reader = TierReader(self.context, self.writer, fetch_policy, deadline)

    @property
    def tiers(self) -> dict[str, KVTier]:
        return self.context.tiers

    def __getitem__(self, name: str) -> KVTier:
        return self.context.tiers[name]

    @property
    def shared(self) -> Optional[KVTier]:
        """The fleet's shared tier, if this replica has one."""
        return next((tier for tier in self.tiers.values() if tier.traits.shared), None)

    def rescope(self, scope_digest: bytes) -> dict[str, int]:
        """A hot reload made `scope_digest` the model's scope (call with no request in flight): this
        replica's own tiers delete the old scope's records, which could never load again (returns how
        many per tier); a shared tier switches to the new scope's keys and leaves the old ones to
        replicas still serving that version."""
        self.context.scope_digest = scope_digest
        self.reader.fetches.clear()
        self.writer.forget_written()
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

    def tokens_by_tier(self, request: Request) -> dict[str, int]:
        """{"device", "host", "disk", "remote"} tokens of the request's cached prefix (num_cached_tokens is
        their sum)."""
        cached = request.num_cached_tokens
        fetch = self.reader.fetches.get(request.request_id)
        counts = empty_breakdown(cached)
        if fetch is not None:
            for name in self.tiers:  # nearest first
                tokens = min(fetch.num_blocks.get(name, 0) * self.context.block_size, counts["device"])
                counts[name] = tokens
                counts["device"] -= tokens
        return counts

    def snapshot(self) -> dict[str, "TierSnapshot"]:
        """Per tier: counters, usage, hit tokens and fetch latencies, for metrics (engine thread)."""
        reader = self.reader
        return {
            name: TierSnapshot(
                stats=tier.stats,
                used_bytes=tier.used_bytes,
                capacity_bytes=tier.capacity_bytes,
                hit_tokens=reader.hit_tokens[name],
                fetch_buckets=reader.fetch_latency[name].cumulative(),
                fetch_seconds_sum=reader.fetch_latency[name].total,
                rejections=tier.rejections,
            )
            for name, tier in self.tiers.items()
        }

    def close(self) -> None:
        """Flush what is queued for disk and stop the tiers' threads (a clean shutdown)."""
        for tier in self.tiers.values():
            tier.close()


def empty_breakdown(num_cached_tokens: int) -> dict[str, int]:
    """All cached tokens from the device pool (no tiers, or none of them used)."""
    return {"device": num_cached_tokens, "host": 0, "disk": 0, "remote": 0}
