"""The background policy that pins hot shared prefixes, and unpins them when they cool.

A prefix is hot when at least `min_requests` distinct requests reused it within the
last `window_seconds` (a reuse = an admission whose cached prefix reached that block).
Hot prefixes are pinned in the radix cache, so a flood of one-off prompts cannot evict
a system prompt everyone shares; a prefix whose reuse count falls below the threshold
is unpinned and ages out by LRU like any other.

    observe(path)   after each admission with a hit: path = the keys of its cached prefix
    tick(cache)     now and then (the engine calls it between steps): pin what turned
                    hot, unpin what cooled; pins stay within `max_blocks` (and the cache's
                    own max_pinned_blocks), hottest first

Every block of a hit is counted (requests that share a system prompt diverge at different
depths after it), and the deepest hot blocks are pinned: pinning one pins its whole path,
and an ancestor shared by several hot paths is pinned once per path (pin counts stack).
Standard library only; bounded: at most `max_tracked` blocks are counted at once (the
least recently reused are forgotten first, never one this policy pinned).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .tenant_pins import TenantPins

DEFAULT_TICK_SECONDS = 1.0
DEFAULT_MAX_TRACKED = 50_000


@dataclass
class _Tracked:
    parent: Optional[bytes]  # the key before it on its path (None for block 0)
    hits: deque  # admission times within the window
    pinned_path: tuple[bytes, ...] = ()  # what this key's pin holds (empty: not pinned by us)
    pinned_for: Optional[str] = None  # the tenant whose pin_share the pin counts against (None: nobody's)


@dataclass(frozen=True)
class HotPrefixChange:
    num_pinned: int  # prefixes pinned by this tick
    num_unpinned: int


class HotPrefixPolicy:
    def __init__(
        self,
        min_requests: int,
        window_seconds: float,
        max_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        tick_seconds: float = DEFAULT_TICK_SECONDS,
        max_tracked: int = DEFAULT_MAX_TRACKED,
        tenant_pins: Optional[TenantPins] = None,
    ) -> None:
        if min_requests < 2:
            raise ValueError(f"min_requests must be at least 2 (one request is not sharing), got {min_requests}")
        if window_seconds <= 0 or max_blocks < 0 or max_tracked < 1:
            raise ValueError(
                "window_seconds must be positive, max_blocks non-negative, max_tracked at least 1; got "
                f"{window_seconds}, {max_blocks}, {max_tracked}"
            )
        self.min_requests = min_requests
        self.window_seconds = window_seconds
        self.max_blocks = max_blocks
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.max_tracked = max_tracked
        # A tenant's private hot prefix is pinned within its pin_share (tenant_pins.py); a public one, nobody's.
        self.tenant_pins = tenant_pins
        self._tracked: OrderedDict[bytes, _Tracked] = OrderedDict()  # block key -> its reuse, least recent first
        self._next_tick = float("-inf")
        self.num_pinned_blocks = 0

    def observe(self, path: Sequence[bytes]) -> None:
        """An admission reused the cached prefix along `path` (block keys, root first): each of its
        blocks was reused once more."""
        now = self.clock()
        parent = None
        for key in path:
            tracked = self._tracked.get(key)
            if tracked is None:
                tracked = self._tracked[key] = _Tracked(parent, deque())
            else:
                self._tracked.move_to_end(key)
            tracked.hits.append(now)
            parent = key
        excess = len(self._tracked) - self.max_tracked
        for key in list(self._tracked)[: max(excess, 0)]:  # least recently reused first; never a pinned one
            if not self._tracked[key].pinned_path:
                del self._tracked[key]

    def tick(self, cache, force: bool = False) -> Optional[HotPrefixChange]:
        """Pin what turned hot and unpin what cooled (at most once per tick_seconds unless forced)."""
        now = self.clock()
        if not force and now < self._next_tick:
            return None
        self._next_tick = now + self.tick_seconds
        horizon = now - self.window_seconds
        num_unpinned = 0
        for key in list(self._tracked):
            tracked = self._tracked[key]
            while tracked.hits and tracked.hits[0] < horizon:
                tracked.hits.popleft()
            if tracked.pinned_path and len(tracked.hits) < self.min_requests:
                self._unpin(cache, tracked)
                num_unpinned += 1
            if not tracked.hits and not tracked.pinned_path:
                del self._tracked[key]
        hot = {key for key, tracked in self._tracked.items() if len(tracked.hits) >= self.min_requests}
        below_hot = {self._tracked[key].parent for key in hot}
        # The deepest hot blocks: pinning one pins its whole path, the hottest first.
        deepest = sorted(
            (key for key in hot - below_hot if not self._tracked[key].pinned_path),
            key=lambda key: len(self._tracked[key].hits),
            reverse=True,
        )
        num_pinned = sum(1 for key in deepest if self._pin(cache, self._tracked[key], self._path_to(key)))
        return HotPrefixChange(num_pinned, num_unpinned)

    def _path_to(self, key: bytes) -> tuple[bytes, ...]:
        path = []
        node: Optional[bytes] = key
        while node is not None:
            path.append(node)
            tracked = self._tracked.get(node)
            node = tracked.parent if tracked is not None else None
        return tuple(reversed(path))

    def _pin(self, cache, tracked: _Tracked, path: tuple[bytes, ...]) -> bool:
        if self.num_pinned_blocks + len(path) > self.max_blocks:
            return False
        deepest = cache.get(path[-1])
        owner = deepest.owner if deepest is not None else None
        if self.tenant_pins is not None and not self.tenant_pins.has_room(owner, len(path)):
            return False  # its tenant's pins hold their share already
        try:
            num_blocks = cache.pin(path)
        except ValueError:  # the cache's own cap (operator pins count too)
            return False
        if num_blocks == 0:  # evicted since its last reuse: nothing to protect
            return False
        if self.tenant_pins is not None:
            self.tenant_pins.claim(owner, num_blocks)
        tracked.pinned_path, tracked.pinned_for = path[:num_blocks], owner
        self.num_pinned_blocks += num_blocks
        return True

    def _unpin(self, cache, tracked: _Tracked) -> None:
        cache.unpin(tracked.pinned_path)
        self._unclaim(tracked)

    def _unclaim(self, tracked: _Tracked) -> None:
        if self.tenant_pins is not None:
            self.tenant_pins.release(tracked.pinned_for, len(tracked.pinned_path))
        self.num_pinned_blocks -= len(tracked.pinned_path)
        tracked.pinned_path, tracked.pinned_for = (), None

    def unpin_all(self, cache) -> int:
        """Give every policy pin back (the pool is too tight for a request); returns blocks unpinned."""
        num_blocks = self.num_pinned_blocks
        for tracked in self._tracked.values():
            if tracked.pinned_path:
                self._unpin(cache, tracked)
        return num_blocks

    def reset(self) -> None:
        """The cache was cleared (a reload): its pins are gone, and so are the counts."""
        for tracked in self._tracked.values():
            if tracked.pinned_path:
                self._unclaim(tracked)
        self._tracked.clear()
        self.num_pinned_blocks = 0

    @property
    def pinned_paths(self) -> list[tuple[bytes, ...]]:
        return [tracked.pinned_path for tracked in self._tracked.values() if tracked.pinned_path]
