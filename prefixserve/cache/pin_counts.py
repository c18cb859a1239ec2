"""Pin counts on the radix index: which cached blocks are pinned, how many, and the cap on them.

Pins nest (a count per block) and a pin covers a whole path from the scope, so the ancestors of a
pinned block stay too. The radix hands in paths of cached blocks and tells these counts when a
pinned block gains its first reference or loses its last, or leaves the index; it subtracts the
pinned blocks no request holds from the ones eviction could free.
"""

from __future__ import annotations

from typing import Sequence

from .block_pool import Block


class PinCapError(ValueError):
    """A pin past max_pinned_blocks: the message names the cap."""


class PinCounts:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks  # pins may never take the whole pool, or running requests could starve
        self.num_pinned = 0
        self.num_unreferenced = 0  # pinned blocks no request holds
        self.unreferenced_by_owner: dict = {}  # the same, by owning tenant (Block.owner)

    def pin(self, path: Sequence[Block]) -> int:
        """Pin every block of a cached path once more; returns the blocks pinned. Past the cap, nothing changes
        and ValueError names the cap."""
        num_new = sum(1 for block in path if block.pin_count == 0)
        if self.num_pinned + num_new > self.max_blocks:
            raise PinCapError(
                f"pinning {num_new} more blocks would exceed max_pinned_blocks={self.max_blocks} "
                f"({self.num_pinned} already pinned); unpin other prefixes or raise the cap"
            )
        for block in path:
            if block.pin_count == 0:
                self.num_pinned += 1
                if block.ref_count == 0:
                    self._count_unreferenced(block, 1)
            block.pin_count += 1
        return len(path)

    def unpin(self, path: Sequence[Block]) -> list[Block]:
        """Undo one pin of each pinned block of `path`, tail first; returns those blocks, tail first (the radix
        offers each to eviction)."""
        unpinned = [block for block in reversed(path) if block.pin_count > 0]
        for block in unpinned:
            block.pin_count -= 1
            if block.pin_count == 0:
                self.num_pinned -= 1
                if block.ref_count == 0:
                    self._count_unreferenced(block, -1)
        return unpinned

    def referenced(self, block: Block) -> None:
        """`block` just gained its first reference."""
        if block.pin_count:
            self._count_unreferenced(block, -1)

    def unreferenced(self, block: Block) -> None:
        """`block` just lost its last reference."""
        if block.pin_count:
            self._count_unreferenced(block, 1)

    def forget(self, block: Block) -> None:
        """`block` leaves the index: its pins go with it."""
        if block.pin_count:
            self.num_pinned -= 1
            if block.ref_count == 0:
                self._count_unreferenced(block, -1)
            block.pin_count = 0

    def unreferenced_of(self, owner) -> int:
        return self.unreferenced_by_owner.get(owner, 0)

    def _count_unreferenced(self, block: Block, delta: int) -> None:
        self.num_unreferenced += delta
        self.unreferenced_by_owner[block.owner] = self.unreferenced_by_owner.get(block.owner, 0) + delta
