"""Pins on the radix index: a pinned path of cached blocks is never evicted or expired, within
max_pinned_blocks. A part of RadixCache (radix.py); pins nest (a count per block), and a pin
covers the whole path from the scope, so the ancestors of a pinned block stay too.
"""

from __future__ import annotations

from typing import Sequence

from .block_pool import Block


class RadixPins:
    """RadixCache's pins (a mixin: RadixCache.__init__ sets _index, _order, max_pinned_blocks and the
    _num_pinned and _num_reclaimable counters these keep)."""

    def _cached_path(self, keys: Sequence[bytes]) -> list[Block]:
        path: list[Block] = []
        for key in keys:
            block = self._index.get(key)
            if block is None or (path and block.parent is not path[-1]):
                break
            path.append(block)
        return path

    def pin(self, keys: Sequence[bytes]) -> int:
        """Protect the cached prefix along `keys` from eviction; returns blocks pinned."""
        path = self._cached_path(keys)
        num_new = sum(1 for block in path if block.pin_count == 0)
        if self._num_pinned + num_new > self.max_pinned_blocks:
            raise ValueError(
                f"pinning {num_new} more blocks would exceed max_pinned_blocks={self.max_pinned_blocks} "
                f"({self._num_pinned} already pinned); unpin other prefixes or raise the cap"
            )
        for block in path:
            if block.pin_count == 0:
                self._num_pinned += 1
                if block.ref_count == 0:
                    self._num_reclaimable -= 1
            block.pin_count += 1
        return len(path)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Undo one `pin` of the cached prefix along `keys`; returns blocks unpinned."""
        path = [block for block in self._cached_path(keys) if block.pin_count > 0]
        for block in reversed(path):
            block.pin_count -= 1
            if block.pin_count == 0:
                self._num_pinned -= 1
                if block.ref_count == 0:
                    self._num_reclaimable += 1
                self._order.push_if_evictable(block, self._num_reclaimable)
        return len(path)
