"""The host-RAM tier: encoded records in a dict, leaf-first LRU, one lock.

Records are kept encoded (checksum and all) so a read is verified exactly like a
disk read, and a record can move to a lower tier as it is.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from ..cache.tenant_shares import NO_SHARES, TenantHoldings, TenantShares
from .base import KVTier, TierTraits
from .lru import LeafFirstLRU
from .policy import TierCost
from .record import BlockRecord
from .seal import Sealer

HOST_READ_COST = TierCost(latency_seconds=2e-6, bytes_per_second=5e9)  # a prior until reads are observed


class HostTier(KVTier):
    name = "host"
    traits = TierTraits(synchronous=True, write_through=False, shared=False, event_medium="CPU")

    def __init__(self, capacity_bytes: int, sealer: Optional[Sealer] = None, shares: TenantShares = NO_SHARES) -> None:
        super().__init__(
            capacity_bytes,
            TierCost(HOST_READ_COST.latency_seconds, HOST_READ_COST.bytes_per_second),
            sealer,
            shares,
        )
        self._records: dict[bytes, bytes] = {}

    def get(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        start = time.perf_counter()
        results: list[Optional[bytes]] = []
        with self._lock:
            for key in keys:
                data = self._records.get(key)
                if data is not None:
                    self._lru.touch(self._lru.get(key))
                results.append(data)
        return self._account_reads(results, start)

    def _put_one(self, record: BlockRecord) -> bool:
        with self._lock:
            entry = self._lru.get(record.key)
            if entry is not None:  # same key, same KV: refresh instead of copying again
                self._lru.claim(entry, record.owner)
                self._lru.touch(entry)
                return True
        data = self.encode(record)  # outside the lock: the checksum or seal pass is the slow part
        with self._lock:
            admission = self._lru.insert_and_evict(
                record.key, record.parent_key, len(data), self.capacity_bytes, record.owner
            )
            for victim in admission.evicted:
                del self._records[victim.key]
            self._count_locked(evictions=len(admission.evicted))
            if admission.admitted:
                self._records[record.key] = data
                self._count_locked(bytes_written=len(data))
            else:
                self._records.pop(record.key, None)
                self._count_locked(dropped_puts=1)
            return admission.admitted

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if self._lru.remove(key) is not None:
                    del self._records[key]

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self._lru = LeafFirstLRU(TenantHoldings(self._lru.holdings.shares, self.capacity_bytes))

    def check_integrity(self) -> None:
        with self._lock:
            self._lru.check_integrity()
            assert set(self._records) == set(self._lru.keys()), "records and index hold different keys"
            for key, data in self._records.items():
                assert len(data) == self._lru.get(key).size, f"{key.hex()} size is off"
            assert self._lru.used_bytes <= self.capacity_bytes, "over capacity"
