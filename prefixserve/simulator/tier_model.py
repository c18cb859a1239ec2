"""The tiers below a simulated replica's pool: its own host and disk, and the fleet-shared remote.

Capacity is counted in trace blocks, like the pool's. Each tier keeps the index
the engine's tiers keep (tiers/lru.LeafFirstLRU), so a suffix never outlives its
prefix within a tier. How blocks get in:

    pool ──evict a cold LRU leaf──> host        spill (the only way into host)
    prefill ──every computed block──> disk      write-through, this replica's
                                  └──> remote   write-through, every replica's, one shared store

Admission continues the pool's match through the tiers for the consecutive run
and the engine's planner decides how much of it to read back: both are the
engine's own (tiers/policy.find_run and choose_fetch). A read leaves the record where it was (the tiers are
copies) and refreshes
its LRU position. Writes cost nothing here: they happen off the prefill's path.
"""

from __future__ import annotations

from typing import Optional, Sequence

from prefixserve.tiers.lru import LeafFirstLRU
from prefixserve.tiers.policy import find_run


class SimulatedTier:
    """One tier's contents: keys of cached blocks, evicted least recently used leaf first."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the {name} tier needs at least 1 block, got {capacity_blocks}")
        self.name, self.capacity_blocks = name, capacity_blocks
        self.index = LeafFirstLRU()
        self.num_written_blocks = 0  # new records (a block already present is only refreshed)
        self.num_dropped_blocks = 0  # records evicted to make room

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of `keys` held (no LRU refresh), as a real tier answers."""
        return self.index.leading_run(keys)

    def __len__(self) -> int:
        return len(self.index)

    def put(self, key: bytes, parent_key: Optional[bytes]) -> None:
        entry = self.index.get(key)
        if entry is not None:
            self.index.touch(entry)
            return
        admission = self.index.insert_and_evict(key, parent_key, 1, self.capacity_blocks)
        self.num_written_blocks += admission.admitted
        self.num_dropped_blocks += len(admission.evicted)

    def touch(self, key: bytes) -> None:
        entry = self.index.get(key)
        if entry is not None:
            self.index.touch(entry)


class ReplicaTiers:
    """What one replica reaches below its pool, in fetch order: its host, its disk, the shared remote."""

    def __init__(
        self,
        host: Optional[SimulatedTier] = None,
        disk: Optional[SimulatedTier] = None,
        remote: Optional[SimulatedTier] = None,
    ) -> None:
        self.host, self.disk, self.remote = host, disk, remote
        self.tiers = [tier for tier in (host, disk, remote) if tier is not None]

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def run(self, keys: Sequence[bytes], start: int, limit: int) -> list[tuple[str, int]]:
        """keys[start:limit]'s leading run held below the pool, as (tier, blocks) segments in chain order."""
        return find_run(self.tiers, keys[:limit], start)

    def read(self, keys: Sequence[bytes], start: int, segments: Sequence[tuple[str, int]], num_blocks: int) -> None:
        """Fetch keys[start : start + num_blocks], the run's leading blocks: refresh their LRU positions."""
        by_name = {tier.name: tier for tier in self.tiers}
        i, end = start, start + num_blocks
        for name, length in segments:
            for key in keys[i : min(i + length, end)]:
                by_name[name].touch(key)
            i += length

    def spill(self, key: bytes, parent_key: Optional[bytes]) -> None:
        """A cold block leaves the pool: keep a copy in host memory."""
        if self.host is not None:
            self.host.put(key, parent_key)

    def write_through(self, key: bytes, parent_key: Optional[bytes]) -> None:
        """A block was just computed: store it on this replica's disk and in the shared remote."""
        for tier in (self.disk, self.remote):
            if tier is not None:
                tier.put(key, parent_key)
