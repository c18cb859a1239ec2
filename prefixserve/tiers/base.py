"""The interface of a KV tier below the device pool: host RAM, local disk, later a remote store.

A tier stores encoded records (record.py) by block key: bytes in, bytes out. It
never decides whether bytes are right; the reader decodes them against what it
expects and calls `reject` on a mismatch, which deletes the record and counts it.
Every tier evicts least-recently-used leaves first (lru.py), so a prefix outlives
its tails, and every tier is thread-safe: the engine thread and background I/O
threads call it at once.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from ..cache.tenant_shares import NO_SHARES, TenantHoldings, TenantShares
from .lru import LeafFirstLRU
from .policy import TierCost
from .record import BlockRecord, encode_record
from .seal import Sealer

logger = logging.getLogger("prefixserve.tiers")


@dataclass
class TierStats:
    """Monotonic counters of one tier (Prometheus counters map onto these one to one)."""

    hits: int = 0  # keys `get` returned bytes for
    misses: int = 0  # keys `get` found nothing (or nothing readable) for
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0  # records removed to make room
    rejected_records: int = 0  # records that failed verification (on read or at start-up): deleted
    dropped_puts: int = 0  # records not stored: too big, no leaf to evict, queue full, closed, or an I/O fault
    errors: int = 0  # I/O faults (each also logged, once per kind)
    reclaimed_records: int = 0  # records of another scope removed at start-up
    slow_reads: int = 0  # reads a request gave up on after the tier deadline (it recomputed)


@dataclass(frozen=True)
class TierTraits:
    """What a tier is, for whoever drives it (the engine's TieredKV, the simulator): read these, never a name."""

    synchronous: bool  # a read is a memory copy, done on the engine thread; else on the tier's reader threads
    write_through: bool  # every block computed is written to it; else it holds what the device pool evicts
    shared: bool  # one store for the whole fleet: a reload keeps the old version's records for replicas still
    #               serving it, and a block brought back from any tier is not written back to it
    event_medium: Optional[str] = None  # the KV-event medium a router mirrors it as; None: not published


class KVTier(abc.ABC):
    name: str = ""  # a label for statistics, metrics and logs
    traits: TierTraits

    def __init__(
        self,
        capacity_bytes: int,
        read_cost: TierCost,
        sealer: Optional[Sealer] = None,
        shares: TenantShares = NO_SHARES,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"a {self.name} tier needs capacity_bytes >= 0, got {capacity_bytes}")
        self.sealer = sealer  # None: records carry a CRC only (anyone who can write the tier can forge them)
        self.capacity_bytes = capacity_bytes
        self.read_cost = read_cost  # refreshed from this tier's reads; the fetch planner's input
        self._lock = (
            threading.RLock()
        )  # guards the index and `_stats`; re-entrant so helpers may count and log under it
        self._stats = TierStats()
        self._rejections: dict[str, int] = {}  # rejected_records by RecordError.reason
        self._logged_failures: set[tuple[str, str]] = set()
        # Every key present, with sizes, recency, children and owners (against `shares`): under `_lock`.
        self._lru = LeafFirstLRU(TenantHoldings(shares, capacity_bytes))
        self._readers: Optional[ThreadPoolExecutor] = None  # set by tiers whose reads are slow (disk, remote)

    # ---------------------------------------------------------------- interface
    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of `keys` present (no LRU refresh, no hit counted)."""
        with self._lock:
            return self._lru.leading_run(keys)

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        """Encoded records, None where missing; a hit refreshes the record's recency."""

    def put(self, records: Sequence[BlockRecord]) -> None:
        """Store records, evicting leaves as needed; a record that cannot be stored is dropped and counted."""
        dropped: set[bytes] = set()
        for record in records:
            if record.parent_key in dropped:  # its parent did not fit: it would only push out older prefixes
                self._count(dropped_puts=1)
                dropped.add(record.key)
            elif not self._put_one(record):
                dropped.add(record.key)

    @abc.abstractmethod
    def _put_one(self, record: BlockRecord) -> bool:
        """Store one record (evicting leaves as needed); False when it was dropped."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove records (absent keys are ignored)."""

    def rescope(self, scope_digest: bytes) -> Optional[int]:
        """A hot reload made `scope_digest` the model's scope (flush first): a replica's own tier deletes
        the old scope's records, which could never load again, and returns how many; a shared tier
        overrides this to read and write the new scope's keys, leaving the old ones to the fleet (None)."""
        keys = self.keys()
        self.delete(keys)
        return len(keys)

    def keys(self) -> list[bytes]:
        """Every key present."""
        with self._lock:
            return self._lru.keys()

    @property
    def used_bytes(self) -> int:
        """Bytes of the records held (encoded length)."""
        with self._lock:
            return self._lru.used_bytes

    @abc.abstractmethod
    def close(self) -> None:
        """Finish pending work and release resources; idempotent."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert every invariant of the tier; call while no operation is in flight."""

    # ---------------------------------------------------- shared conveniences
    def tenant_holdings(self) -> dict:
        """tenant -> {held, min, max} in bytes of this tier (TenantHoldings.report)."""
        with self._lock:
            return self._lru.holdings.report()

    @property
    def stats(self) -> TierStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    @property
    def rejections(self) -> dict[str, int]:
        """Rejected records by reason (record.REASONS: "auth", "nonfinite", "checksum", ...)."""
        with self._lock:
            return dict(self._rejections)

    def fetch(self, keys: Sequence[bytes]) -> "Future[list[Optional[bytes]]]":
        """`get` without blocking the caller: on the tier's reader threads when it has them (slow reads),
        else done at once."""
        if self._readers is not None:
            try:
                return self._readers.submit(self.get, list(keys))
            except RuntimeError:  # closed: read in the caller
                pass
        future: Future[list[Optional[bytes]]] = Future()
        try:
            future.set_result(self.get(keys))
        except Exception as error:  # a tier's bug reaches the caller through the future, as with a pool
            future.set_exception(error)
        return future

    def put_async(self, records: Sequence[BlockRecord]) -> None:
        """`put` without blocking the caller; here synchronous, a tier with slow writes overrides it."""
        self.put(records)

    def flush(self) -> None:
        """Wait until everything `put_async` accepted is stored (nothing to wait for here: `put_async` is `put`)."""
        return None

    def watch(self, on_added: Callable[[bytes], None], on_removed: Callable[[bytes], None]) -> None:
        """Be told of every key that enters or leaves this tier from now on (under the tier's lock: keep it short)."""
        with self._lock:
            self._lru.on_added, self._lru.on_removed = on_added, on_removed

    def _account_reads(
        self, results: list[Optional[bytes]], started: float, num_memory_bytes: int = 0
    ) -> list[Optional[bytes]]:
        """Count a `get`'s hits, misses and bytes, and teach `read_cost` how long it took; returns `results`.

        `num_memory_bytes` of them came from memory, not the medium (a write still queued): counted, not timed."""
        num_hits = sum(data is not None for data in results)
        num_bytes = sum(len(data) for data in results if data is not None)
        self._count(hits=num_hits, misses=len(results) - num_hits, bytes_read=num_bytes)
        if num_bytes > num_memory_bytes:
            self.read_cost.observe(num_bytes - num_memory_bytes, time.perf_counter() - started)
        return results

    def count_slow_read(self, deadline: float) -> None:
        """A read outlived the deadline; the request recomputed. Logged once, counted always."""
        self._count(slow_reads=1)
        self._log_once(
            "read",
            "slow",
            "%s tier: a read took longer than the %.2f s deadline; the request recomputed "
            "and the tier is skipped until that read returns (counted in slow_reads)",
            self.name,
            deadline,
        )

    def reject(self, key: bytes, reason: str) -> None:
        """A record read from this tier failed verification (RecordError.reason): delete it and count it."""
        self.delete([key])
        with self._lock:
            self._count_locked(rejected_records=1)
            self._rejections[reason] = self._rejections.get(reason, 0) + 1
        self._log_once(
            "rejected",
            reason,
            "%s tier: rejected a record (%s); it was deleted and will be recomputed",
            self.name,
            reason,
        )

    def __enter__(self) -> "KVTier":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(used={self.used_bytes}, capacity={self.capacity_bytes})"

    # ------------------------------------------------------------- for tiers
    def encode(self, record: BlockRecord) -> bytes:
        """The bytes this tier stores for `record`: sealed when the tier has a sealer."""
        return encode_record(record, self.sealer)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._count_locked(**deltas)

    def _count_locked(self, **deltas: int) -> None:
        """Add to the counters; the caller holds `self._lock`."""
        for counter, delta in deltas.items():
            setattr(self._stats, counter, getattr(self._stats, counter) + delta)

    def _log_once(self, operation: str, kind: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        """Log the first failure of each (operation, kind); repeats only count, so a full disk cannot flood the log."""
        with self._lock:
            if (operation, kind) in self._logged_failures:
                return
            self._logged_failures.add((operation, kind))
        logger.log(level, message, *args)
