"""The order in which a tier's records leave: least recently used leaves first.

A record's parent is the record of the block before it. A suffix is useless
without its prefix, so a record is evictable only while no child of it is in the
same tier: in

    b0 ─ b1 ─ b2          (b2, b4 are leaves)
          └── b3 ─ b4

b1 goes only after b2, b3 and b4, however long ago b1 was used. A child whose
parent lives in another tier (or nowhere) is a leaf like any other.

Children are counted by parent *key*, whether or not the parent is present, so
records may arrive in any order. Leaves sit in a heap by last access (a logical
clock, so no ties) with lazy deletion: a popped entry whose record was touched,
removed or gained a child since is skipped. O(log n) per operation, amortised.
Not thread-safe: each tier calls it under its own lock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

STALE_SLACK = 64  # stale heap entries tolerated beyond twice the live records before a rebuild


@dataclass(eq=False)
class Entry:
    key: bytes
    parent_key: Optional[bytes]
    size: int
    last_access: int = 0


@dataclass
class Admission:
    admitted: bool  # False: the record did not fit (it may have been evicted at once)
    evicted: list[Entry] = field(default_factory=list)  # other records that left to make room


class LeafFirstLRU:
    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._num_children: dict[bytes, int] = {}  # parent key -> children present (only counts > 0)
        self._heap: list[tuple[int, bytes]] = []  # (last access, key) of leaves, lazily deleted
        self._tick = 0
        self.used_bytes = 0
        # Told of every key that enters or leaves (KV events of the tier's medium); called under the tier's lock.
        self.on_added: Optional[Callable[[bytes], None]] = None
        self.on_removed: Optional[Callable[[bytes], None]] = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Optional[Entry]:
        return self._entries.get(key)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def leading_run(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are present."""
        for index, key in enumerate(keys):
            if key not in self._entries:
                return index
        return len(keys)

    def is_leaf(self, key: bytes) -> bool:
        return key not in self._num_children

    def add(self, key: bytes, parent_key: Optional[bytes], size: int) -> Entry:
        """Insert (or replace) a record as the most recently used."""
        self.remove(key)
        entry = Entry(key, parent_key, size)
        self._entries[key] = entry
        self.used_bytes += size
        if parent_key is not None:
            self._num_children[parent_key] = self._num_children.get(parent_key, 0) + 1
        self.touch(entry)
        if self.on_added is not None:
            self.on_added(key)
        return entry

    def touch(self, entry: Entry) -> None:
        self._tick += 1
        entry.last_access = self._tick
        self._push_if_leaf(entry)

    def remove(self, key: bytes) -> Optional[Entry]:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        if self.on_removed is not None:
            self.on_removed(key)
        self.used_bytes -= entry.size
        parent_key = entry.parent_key
        if parent_key is not None:
            remaining = self._num_children[parent_key] - 1
            if remaining:
                self._num_children[parent_key] = remaining
            else:
                del self._num_children[parent_key]
                parent = self._entries.get(parent_key)
                if parent is not None:
                    self._push_if_leaf(parent)  # its last child left: it is a candidate again
        return entry

    def pop_lru_leaf(self) -> Optional[Entry]:
        """Remove and return the least recently used leaf; None when there is none."""
        heap = self._heap
        while heap:
            last_access, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry.last_access == last_access and self.is_leaf(key):
                self.remove(key)
                return entry
        return None

    def insert_and_evict(self, key: bytes, parent_key: Optional[bytes], size: int, capacity: int) -> Admission:
        """Add a record, then evict LRU leaves until `capacity` holds.

        The record goes in before anything leaves, so its parent is no longer a
        leaf and cannot be evicted to make room for its own child.
        """
        if size > capacity:
            return Admission(False)
        self.add(key, parent_key, size)
        admission = Admission(True)
        while self.used_bytes > capacity:
            victim = self.pop_lru_leaf()
            if victim is None:  # only a parent cycle leaves no leaf; give the room back
                self.remove(key)
                admission.admitted = False
                break
            if victim.key == key:  # the newest record was the only leaf left
                admission.admitted = False
                break
            admission.evicted.append(victim)
        return admission

    def entries(self) -> Iterable[Entry]:
        return self._entries.values()

    def check_integrity(self) -> None:
        """Byte count, child counts, and heap == leaves; tests call it after every operation."""
        assert self.used_bytes == sum(e.size for e in self._entries.values()), "used_bytes is off"
        children: dict[bytes, int] = {}
        for entry in self._entries.values():
            assert entry.parent_key != entry.key, f"{entry.key.hex()} is its own parent"
            if entry.parent_key is not None:
                children[entry.parent_key] = children.get(entry.parent_key, 0) + 1
        assert children == self._num_children, "child counts are off"
        live = {key for last, key in self._heap if self._valid(last, key)}
        leaves = {key for key in self._entries if self.is_leaf(key)}
        assert live == leaves, f"heap holds {len(live)} live leaves, there are {len(leaves)}"

    def _valid(self, last_access: int, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.last_access == last_access and self.is_leaf(key)

    def _push_if_leaf(self, entry: Entry) -> None:
        if not self.is_leaf(entry.key):
            return
        heapq.heappush(self._heap, (entry.last_access, entry.key))
        if len(self._heap) > 2 * len(self._entries) + STALE_SLACK:
            self._heap = [item for item in set(self._heap) if self._valid(*item)]
            heapq.heapify(self._heap)
