"""A router-side mirror of one replica's cache: the keys its pool (and its tiers below) hold, from its KV events.

Policies read a replica's predicted hit from it (`num_hit_blocks`, `leading_run`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from prefixserve.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, max_hit_blocks
from prefixserve.cache.events import DEVICE_MEDIUM

from .policies import RouteRequest


class PrefixMirror:
    """A router-side copy of one replica's cached keys, kept current from its KV events.

    Chained keys make a set enough: key i exists only if blocks 0..i matched, and
    a replica evicts leaves first, so the leading run of present keys is its hit.
    """

    def __init__(self) -> None:
        self.keys: set[bytes] = set()  # the device pool's
        self.tier_keys: dict[str, set[bytes]] = {}  # the replica's own tiers below its pool, by medium

    def _keys_of(self, medium: Optional[str]) -> set[bytes]:
        return self.keys if medium in (None, DEVICE_MEDIUM) else self.tier_keys.setdefault(medium, set())

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._keys_of(event.medium).update(event.keys)
        elif isinstance(event, BlockRemoved):
            self._keys_of(event.medium).difference_update(event.keys)
        elif isinstance(event, AllBlocksCleared):
            if event.medium is None:
                self.keys.clear()
                self.tier_keys.clear()
            else:
                self._keys_of(event.medium).clear()

    def clear(self) -> None:
        self.keys.clear()
        self.tier_keys.clear()

    def leading_run(self, medium: str, keys: Sequence[bytes], start: int, limit: int) -> int:
        """How many of keys[start:limit] the tier of this medium holds, from the first."""
        held = self.tier_keys.get(medium, ())
        count = 0
        for key in keys[start:limit]:
            if key not in held:
                break
            count += 1
        return count

    def num_hit_blocks(self, request: RouteRequest) -> int:
        limit = max_hit_blocks(request.num_blocks, 1, len(request.keys))  # num_blocks counts the tail
        for i in range(limit):
            if request.keys[i] not in self.keys:
                return i
        return limit
