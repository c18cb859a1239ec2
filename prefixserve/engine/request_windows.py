"""Which of a request's blocks are attached in the sliding-window layers' pool (cache/window_slots.py), for the
scheduler: a request attaches the blocks its window covers, from `request.window_start` on, and detaches those its
window leaves as it advances; room in that pool is checked with the blocks', and a cached match is cut to where its
last window of blocks is still held. Without such a pool (`slots` None) every call is a no-op."""

from __future__ import annotations

from typing import Optional, Sequence

from ..cache import Block
from ..cache.window_slots import WindowSlots
from .request import Request


def _ids(blocks: Sequence[Block]) -> list[int]:
    return [block.block_id for block in blocks]


class RequestWindows:
    def __init__(self, slots: Optional[WindowSlots]) -> None:
        self.slots = slots

    def usable(self, hit: list[Block]) -> list[Block]:
        """The part of a cached match the window layers can serve."""
        return hit if self.slots is None else hit[: self.slots.usable_hit(hit)]

    def start_of(self, num_cached: int) -> int:
        """The first block a request computing from `num_cached` attaches."""
        return 0 if self.slots is None else self.slots.first_block(num_cached)

    def can_admit(self, hit: list[Block], start: int, num_new_blocks: int) -> bool:
        return self.slots is None or self.slots.can_attach(_ids(hit[start:]), num_new_blocks)

    def fits(self, num_new_blocks: int) -> bool:
        return self.slots is None or self.slots.can_attach((), num_new_blocks)

    def admitted(self, request: Request, start: int) -> None:
        if self.slots is not None:
            request.window_start = start
            self.slots.attach(_ids(request.blocks[start:]))

    def allocated(self, blocks: Sequence[Block]) -> None:
        if self.slots is not None:
            self.slots.attach(_ids(blocks))

    def slide(self, request: Request) -> None:
        """Detach the blocks the request's window has left (it computes from num_computed_tokens on)."""
        if self.slots is None:
            return
        first = self.slots.first_block(request.num_computed_tokens)
        if first > request.window_start:
            self.slots.detach(_ids(request.blocks[request.window_start : first]))
            request.window_start = first

    def released(self, request: Request) -> None:
        if self.slots is not None:
            self.slots.detach(_ids(request.blocks[request.window_start :]))
            request.window_start = 0
