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

Each record may belong to a tenant (its block's owner, cache/tenant_shares.py), whose bytes here count
against its share of the tier: past its max_kv_share its own coldest leaves make room (else the record is
not stored), and while it holds no more than its min_kv_share, another tenant's record never evicts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from ..cache.leaf_heaps import LeafHeaps
from ..cache.tenant_shares import NO_SHARES, TenantHoldings


@dataclass(eq=False)
class Entry:
    key: bytes
    parent_key: Optional[bytes]
    size: int
    last_access: int = 0
    owner: Optional[str] = None  # the tenant whose share its bytes count against (None: nobody's)


@dataclass
class Admission:
    admitted: bool  # False: the record did not fit (it may have been evicted at once)
    evicted: list[Entry] = field(default_factory=list)  # other records that left to make room


class LeafFirstLRU:
    def __init__(self, holdings: Optional[TenantHoldings] = None) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._num_children: dict[bytes, int] = {}  # parent key -> children present (only counts > 0)
        self._leaves: LeafHeaps[bytes] = LeafHeaps(self._valid)  # (last access, key) of leaves, by owner
        self.holdings = holdings if holdings is not None else TenantHoldings(NO_SHARES, 0)
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

    def add(self, key: bytes, parent_key: Optional[bytes], size: int, owner: Optional[str] = None) -> Entry:
        """Insert (or replace) a record as the most recently used."""
        self.remove(key)
        entry = Entry(key, parent_key, size, owner=owner)
        self._entries[key] = entry
        self.used_bytes += size
        self.holdings.add(owner, size)
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
        self.holdings.remove(entry.owner, entry.size)
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

    def claim(self, entry: Entry, owner: Optional[str]) -> None:
        """A record of nobody's (indexed at start-up) written again by `owner`: its bytes count against it now."""
        if entry.owner is None and owner is not None:
            entry.owner = owner
            self.holdings.add(owner, entry.size)
            self._push_if_leaf(entry)

    def pop_lru_leaf(self) -> Optional[Entry]:
        """Remove and return the least recently used leaf; None when there is none."""
        key = self._leaves.pop()
        return None if key is None else self.remove(key)

    def insert_and_evict(
        self, key: bytes, parent_key: Optional[bytes], size: int, capacity: int, owner: Optional[str] = None
    ) -> Admission:
        """Add `owner`'s record, then evict LRU leaves until its share and `capacity` hold.

        The record goes in before anything leaves, so its parent is no longer a leaf and cannot be
        evicted to make room for its own child. Past its maximum, only its owner's leaves leave; for
        the capacity, another tenant's leaves leave only while it holds more than its minimum.
        """
        if size > capacity:
            return Admission(False)
        self.add(key, parent_key, size, owner)
        admission = Admission(True)
        holdings = self.holdings
        maximum = holdings.maximum(owner)
        while maximum is not None and holdings.held.get(owner, 0) > maximum:
            if not self._evict_for(admission, key, self._leaves.pop_of(owner)):
                return admission
        guarded = holdings.shares.guards_minimums
        while self.used_bytes > capacity:
            victim = self._leaves.pop(self._evictable_for(owner)) if guarded else self._leaves.pop()
            if not self._evict_for(admission, key, victim):
                break
        return admission

    def _evictable_for(self, requester: Optional[str]):
        """Whether `requester`'s record may evict a leaf (owner, key): another tenant's only as far as it keeps
        its minimum in bytes."""
        entries, holdings = self._entries, self.holdings
        return lambda owner, key: holdings.evictable_by(owner, requester, entries[key].size)

    def _evict_for(self, admission: Admission, key: bytes, victim: Optional[bytes]) -> bool:
        """Evict `victim` to make room for `key`; False (and `key` not admitted) when there was none, or it was
        `key` itself (the newest record was the only leaf left that could go)."""
        if victim is None:  # only a parent cycle, or others' minimums, leave no leaf; give the room back
            self.remove(key)
            admission.admitted = False
            return False
        entry = self.remove(victim)
        if victim == key:
            admission.admitted = False
            return False
        admission.evicted.append(entry)
        return True

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
        live = {key for last, key in self._leaves.live()}
        leaves = {key for key in self._entries if self.is_leaf(key)}
        assert live == leaves, f"heap holds {len(live)} live leaves, there are {len(leaves)}"
        held: dict = {}
        for entry in self._entries.values():
            if entry.owner is not None:
                held[entry.owner] = held.get(entry.owner, 0) + entry.size
        assert held == self.holdings.held, f"tenants hold {held}, counted {self.holdings.held}"

    def _valid(self, owner: Optional[str], last_access: int, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.owner == owner and entry.last_access == last_access and self.is_leaf(key)

    def _push_if_leaf(self, entry: Entry) -> None:
        if self.is_leaf(entry.key):
            self._leaves.push(entry.owner, entry.last_access, entry.key, len(self._entries))
