"""Writing KV down the tiers below one engine's pool: spilling what the pool evicts, writing through what it
computes, and publishing each local tier's keys as KV events.

    device pool ──LRU eviction──> host tier          (a cold block's KV is copied out before its slot is reused)
         └──every block computed──> disk, remote     (write-through, on background threads)

A block brought back from a tier is not written back to where it came from, nor to a shared tier: the reader
says where a block came from while it promotes it (`promoting`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ..cache import Block
from ..cache.events import BlockRemoved, BlockStored
from ..tiers import KVTier
from .tier_context import TierContext


class TierWriter:
    def __init__(self, context: TierContext, shared_writes_wait: bool = False) -> None:
        self.context = context
        tiers = list(context.tiers.values())
        # Tiers every computed block is written to, in the background (disk: durability, remote: the fleet),
        # and those that keep what the pool evicts (host).
        self.write_tiers = [tier for tier in tiers if tier.traits.write_through]
        self.spill_tiers = [tier for tier in tiers if not tier.traits.write_through]
        # A prefill replica (EngineConfig.role): the shared tier's writes end before the step does, so a request's
        # KV is there before its answer leaves, for the decode replica the router sends it to next.
        self.shared_writes_wait = shared_writes_wait
        self._written: list[tuple[Block, Optional[str]]] = []  # (block just cached, tier it came from)
        self._promoting_from: Optional[str] = None
        cache = context.cache
        if self.spill_tiers:
            cache.on_evict = self._spill
        if self.write_tiers:
            cache.on_insert = self._note_written
        if cache.events is not None:  # KV events carry each local tier's medium, so a router can mirror them
            for tier in tiers:
                if tier.traits.event_medium is not None:
                    self._publish_tier_events(tier, tier.traits.event_medium, cache.events)

    @contextlib.contextmanager
    def promoting(self, tier_name: str) -> Iterator[None]:
        """Blocks cached inside this block came from `tier_name` (the reader promoting what it read)."""
        self._promoting_from = tier_name
        try:
            yield
        finally:
            self._promoting_from = None

    def forget_written(self) -> None:
        """Drop what was noted for writing (a reload: the old scope's blocks are gone)."""
        self._written.clear()

    def _spill(self, block: Block) -> None:
        """A cold block leaves the pool: keep its KV in host RAM (its slot is still intact), unless its
        request said its KV never leaves the device (cache_retention "device"), or its window layers' K/V is
        already gone (cache/window_slots.py: a record holds every layer)."""
        runner = self.context.runner
        if block.device_only or not runner.holds_every_layer(block.block_id):
            return
        record = self.context.record(block, runner.read_blocks([block.block_id])[0])
        for tier in self.spill_tiers:
            tier.put([record])

    def _publish_tier_events(self, tier: KVTier, medium: str, events) -> None:
        block_size = self.context.block_size
        tier.watch(
            lambda key: events.publish(BlockStored([key], None, [], block_size, medium)),
            lambda key: events.publish(BlockRemoved([key], medium)),
        )

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
        runner = self.context.runner
        payloads: dict[int, bytes] = {}
        for tier in self.write_tiers:
            blocks = [
                block
                for block, source in written
                if block.key is not None
                and source != tier.name
                and not (source is not None and tier.traits.shared)
                and runner.holds_every_layer(block.block_id)
            ]
            if not tier.traits.shared:  # already there: a look-up in this replica's own index
                blocks = [block for block in blocks if not tier.contains([block.key])]
            missing = [block.block_id for block in blocks if block.block_id not in payloads]
            if missing:
                payloads.update(zip(missing, runner.read_blocks(missing)))
            if blocks:
                records = [self.context.record(block, payloads[block.block_id]) for block in blocks]
                if self.shared_writes_wait and tier.traits.shared:
                    tier.put(records)
                else:
                    tier.put_async(records)
