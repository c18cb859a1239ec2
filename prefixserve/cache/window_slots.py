"""Where the sliding-window layers keep a block's K/V: a smaller pool of their own, a slot per block that a
window still needs (issue 27; as vLLM's hybrid allocator and SGLang's SWA radix cache do).

A block id names the same tokens in every layer. The full-attention layers hold every block; the window
layers hold a block's K/V in a *slot* of their own pool, attached while some running request's window covers
the block. A row at position p of a window-w layer reads keys (p - w, p], so a request computing from
position c needs the blocks from (c + 1 - w) // block_size on; blocks below it are detached:

    request at c = 100, w = 40, 16-token blocks       blocks  0 1 2 3 4 5 6
    first key 61 -> first block 3                     slots   . . . a b c d    (a..d attached)

A detached slot keeps its K/V and stays findable (a later request whose match ends where the window's blocks
are still held is a hit) until the pool needs it for another block: least recently detached first. A match is
cut back to the longest prefix whose last window of blocks all have their slots, so a prefix whose window K/V
was reused is a miss there, never wrong K/V; the chain of keys and the full layers' K/V are untouched.

    free        no block; in the free list
    held        a block's K/V; attached by `users` running requests (> 0)
    idle        a block's K/V, no user; in the LRU order, taken when the free list is empty

Plain Python; the engine's runner maps block tables through `slot_of` for the window layers' caches.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class WindowSlots:
    def __init__(self, num_blocks: int, num_slots: int, window: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the window layers' pool needs at least 1 slot, got {num_slots}")
        self.window, self.block_size, self.num_slots = window, block_size, num_slots
        self.slot_of = [-1] * num_blocks  # block id -> slot, -1: none
        self.users = [0] * num_blocks  # running requests whose window covers the block
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()  # block ids with a slot and no user, oldest first
        self.num_reused = 0  # idle slots taken for another block (their K/V gone)

    # --------------------------------------------------------------- queries
    def first_block(self, num_computed: int) -> int:
        """The first block a request computing from position `num_computed` reads on the window layers."""
        return max(0, num_computed + 1 - self.window) // self.block_size

    def usable_hit(self, blocks: Sequence) -> int:
        """How many leading blocks of a cached match can be used: the longest prefix whose window blocks all
        have slots (0 always can). One pass: a prefix of `count` blocks is usable when the last block without a
        slot before it lies below its window's first block."""
        last_missing, missing_before = -1, []  # missing_before[count]: the last slotless block of blocks[:count]
        for index, block in enumerate(blocks):
            missing_before.append(last_missing)
            if self.slot_of[block.block_id] < 0:
                last_missing = index
        missing_before.append(last_missing)
        for count in range(len(blocks), 0, -1):
            if missing_before[count] < self.first_block(count * self.block_size):
                return count
        return 0

    def can_attach(self, block_ids: Sequence[int], num_new: int = 0) -> bool:
        """Whether these blocks, and `num_new` blocks not allocated yet, can all be attached now (those without
        a slot take free or idle ones)."""
        wanted = num_new + sum(1 for block_id in block_ids if self.slot_of[block_id] < 0)
        idle_wanted = sum(1 for block_id in set(block_ids) if block_id in self._idle)  # attaching keeps these
        return wanted <= len(self._free) + len(self._idle) - idle_wanted

    @property
    def num_held(self) -> int:
        return self.num_slots - len(self._free) - len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    # -------------------------------------------------------------- changes
    def attach(self, block_ids: Sequence[int]) -> None:
        """One more user for each block, giving a slot to those without (caller checked can_attach)."""
        for block_id in block_ids:  # taken off the idle order first: giving out slots must not take these
            if self.users[block_id] == 0:
                self._idle.pop(block_id, None)
            self.users[block_id] += 1
        for block_id in block_ids:
            if self.slot_of[block_id] < 0:
                self.slot_of[block_id] = self._take()

    def detach(self, block_ids: Sequence[int]) -> None:
        """One user less for each block; a block left without users keeps its slot, idle."""
        for block_id in block_ids:
            assert self.users[block_id] > 0, f"detach of block {block_id} with no user"
            self.users[block_id] -= 1
            if self.users[block_id] == 0 and self.slot_of[block_id] >= 0:
                self._idle[block_id] = None

    def give_idle(self, block_ids: Sequence[int]) -> list[bool]:
        """Slots for blocks no request uses yet (K/V brought back from a tier), the last ones first where there
        is not room for all (a match needs its last window); never a slot a running request holds. Which of
        them have one now."""
        batch = set(block_ids)
        wanted = [block_id for block_id in block_ids if self.slot_of[block_id] < 0]
        room = len(self._free) + sum(1 for block_id in self._idle if block_id not in batch)
        for block_id in wanted[max(0, len(wanted) - room) :]:
            self.slot_of[block_id] = self._take()
        for block_id in block_ids:  # idle in their order: the earliest are taken first
            if self.slot_of[block_id] >= 0 and self.users[block_id] == 0:
                self._idle.pop(block_id, None)
                self._idle[block_id] = None
        return [self.slot_of[block_id] >= 0 for block_id in block_ids]

    def merge(self, duplicate: int, kept: int) -> None:
        """The radix cache replaced block `duplicate` by its cached copy `kept` (same tokens, same K/V): the
        duplicate's users move to the copy, and its slot too where the copy has none."""
        users = self.users[duplicate]
        if users and self.users[kept] == 0:
            self._idle.pop(kept, None)
        self.users[kept] += users
        self.users[duplicate] = 0
        if self.slot_of[kept] < 0 and self.slot_of[duplicate] >= 0:
            self.slot_of[kept], self.slot_of[duplicate] = self.slot_of[duplicate], -1
            self._idle.pop(duplicate, None)
            if self.users[kept] == 0:
                self._idle[kept] = None
        self.drop(duplicate)

    def drop(self, block_id: int) -> None:
        """The block left the pool: its slot, if any, is free."""
        slot = self.slot_of[block_id]
        self.users[block_id] = 0
        if slot >= 0:
            self._idle.pop(block_id, None)
            self.slot_of[block_id] = -1
            self._free.append(slot)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._idle:
            raise RuntimeError(
                "no free or idle slot in the window layers' pool; the scheduler checks can_attach before attaching"
            )
        block_id, _ = self._idle.popitem(last=False)
        slot, self.slot_of[block_id] = self.slot_of[block_id], -1
        self.num_reused += 1
        return slot
