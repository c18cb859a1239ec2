"""The local-disk tier: one file per record, an in-memory index rebuilt from headers at start-up.

Writes go through a background thread (`put_async`, bounded, never blocking) or
run in the caller (`put`); reads through a small thread pool (`fetch`) or in the
caller (`get`). A record `put_async` accepted is served from memory until its file
lands (read your writes): a slow disk never turns a just-computed block into a miss.
The index lock is never held across a data write or a read: a record is written and
fsynced under a temporary name first, and only the rename into place, the index
update and the eviction's unlinks happen under the lock, so the index always equals
the files and an engine step never waits for the disk.

Faults never reach the caller. A directory that cannot be written, a full disk or
an unreadable file drops the put (or turns the read into a miss), is counted in
`stats.errors` and logged once per kind of failure; the tier keeps serving what it
has. A directory already served by another process is refused (flock), because
each server's start-up removes temporary files and reclaims other scopes' records.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence, Union

from ..cache.tenant_shares import NO_SHARES, TenantShares
from .base import KVTier, TierTraits
from .disk_files import NotARecordFile, read_file, record_path, remove_quietly, scan, write_temp_file
from .disk_startup import HeaderRead, RebuildReport, open_directory
from .lru import Entry
from .policy import TierCost
from .record import BlockRecord
from .seal import Sealer
from .writer import BackgroundWriter

logger = logging.getLogger("prefixserve.tiers")

DISK_READ_COST = TierCost(latency_seconds=1e-4, bytes_per_second=1e9)  # a prior until reads are observed
DEFAULT_MAX_PENDING_BYTES = 256 << 20


class DiskTier(KVTier):
    name = "disk"
    traits = TierTraits(synchronous=False, write_through=True, shared=False, event_medium="DISK")

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        capacity_bytes: int,
        expect_scope: Optional[bytes] = None,
        *,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        num_read_threads: int = 2,
        sealer: Optional[Sealer] = None,
        shares: TenantShares = NO_SHARES,
    ) -> None:
        super().__init__(
            capacity_bytes,
            TierCost(DISK_READ_COST.latency_seconds, DISK_READ_COST.bytes_per_second),
            sealer,
            shares,
        )
        self.directory = Path(directory)
        self.expect_scope = expect_scope
        self._closed = False
        self._queued: dict[bytes, BlockRecord] = {}  # accepted by put_async, file not written yet: under `_lock`
        start = time.perf_counter()
        opened = open_directory(self.directory, expect_scope, self._fault, self._rejected_at_start)
        self._lock_fd = opened.lock_fd
        self._can_write = opened.can_write  # False when another process serves the directory
        self.rebuild_report = opened.report
        if opened.found is not None:
            self._index_at_start(opened.found, opened.report)
            opened.report.seconds = time.perf_counter() - start
            self._log_start(opened.report)
        self._writer = BackgroundWriter(self._write_batch, max_pending_bytes, "prefixserve-disk-writer")
        self._readers = ThreadPoolExecutor(num_read_threads, thread_name_prefix="prefixserve-disk-reader")

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for index, key in enumerate(keys):
                if key not in self._queued and self._lru.get(key) is None:
                    return index
            return len(keys)

    def rescope(self, scope_digest: bytes) -> Optional[int]:
        reclaimed = super().rescope(scope_digest)
        self.expect_scope = scope_digest  # a restart reclaims what another scope left behind
        return reclaimed

    def get(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        with self._lock:
            queued = {index: self._queued[key] for index, key in enumerate(keys) if key in self._queued}
            present = [(index, self._lru.get(key)) for index, key in enumerate(keys) if index not in queued]
            present = [(index, entry) for index, entry in present if entry is not None]
            for _, entry in present:
                self._lru.touch(entry)
        results: list[Optional[bytes]] = [None] * len(keys)
        for index, record in queued.items():
            results[index] = self.encode(record)
        start = time.perf_counter()
        for index, entry in present:
            results[index] = self._read(entry)
        return self._account_reads(results, start, num_memory_bytes=sum(len(results[index]) for index in queued))

    # ----------------------------------------------------------------- writes
    def put_async(self, records: Sequence[BlockRecord]) -> None:
        """Queue records for the writer thread; what does not fit in the queue is dropped and counted."""
        with self._lock:  # visible before the writer can finish them, so never in neither place
            self._queued.update((record.key, record) for record in records)
        num_accepted = self._writer.submit(records)
        if num_accepted < len(records):
            self._unqueue(records[num_accepted:])
            self._count(dropped_puts=len(records) - num_accepted)
            self._log_once(
                "queue",
                "full",
                "disk tier: write queue full (or closed); %d records dropped",
                len(records) - num_accepted,
            )

    def flush(self) -> None:
        self._writer.flush()

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._queued.pop(key, None)  # not served, nor written unless the writer has begun it
                if self._lru.remove(key) is not None:
                    self._unlink_locked(key)

    def close(self) -> None:
        self._writer.close()
        self._readers.shutdown(wait=True)
        with self._lock:
            self._closed = True
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def _write_batch(self, records: list[BlockRecord]) -> None:
        with self._lock:  # a record deleted while queued is not written
            wanted = [record for record in records if self._queued.get(record.key) is record]
        try:
            self.put(wanted)  # each record is in the index (or dropped) before it leaves `_queued`
        finally:
            self._unqueue(records)

    def _unqueue(self, records: Sequence[BlockRecord]) -> None:
        with self._lock:
            for record in records:
                if self._queued.get(record.key) is record:  # not a later put_async of the same key
                    del self._queued[record.key]

    def _put_one(self, record: BlockRecord) -> bool:
        with self._lock:
            if self._closed or not self._can_write:
                self._count_locked(dropped_puts=1)
                return False
            entry = self._lru.get(record.key)
            if entry is not None:  # same key, same KV: refresh instead of writing again
                self._lru.claim(entry, record.owner)
                self._lru.touch(entry)
                return True
        data = self.encode(record)
        if len(data) > self.capacity_bytes:
            self._count(dropped_puts=1)
            return False
        path = record_path(self.directory, record.key)
        try:
            try:
                temp = write_temp_file(path, data)
            except FileNotFoundError:  # the directory was deleted under us: start over in a fresh one
                self._lost_directory()
                temp = write_temp_file(path, data)
        except OSError as error:
            self._fault("write", error)
            self._count(dropped_puts=1)
            return False
        with self._lock:
            try:
                os.replace(temp, path)
            except OSError as error:
                remove_quietly(temp)
                self._fault("write", error)
                self._count_locked(dropped_puts=1)
                return False
            admission = self._lru.insert_and_evict(
                record.key, record.parent_key, len(data), self.capacity_bytes, record.owner
            )
            for victim in admission.evicted:
                self._unlink_locked(victim.key)
            self._count_locked(evictions=len(admission.evicted))
            if admission.admitted:
                self._count_locked(bytes_written=len(data))
            else:
                self._unlink_locked(record.key)
                self._count_locked(dropped_puts=1)
            return admission.admitted

    @property
    def used_bytes(self) -> int:
        """Bytes of the records indexed; a directory deleted under the server holds none."""
        if not self._closed and self._can_write and not self.directory.is_dir():
            self._lost_directory()
        return super().used_bytes

    # ---------------------------------------------------------------- helpers
    def _read(self, entry: Entry) -> Optional[bytes]:
        """A record file's bytes, or None (the index entry dropped) when it is gone, unreadable, not a
        regular file or not the length indexed."""
        damaged = False
        try:
            data = read_file(record_path(self.directory, entry.key), entry.size)
        except FileNotFoundError:
            data = None  # removed behind our back (or the whole directory was)
            self._lost_directory()
        except NotARecordFile as error:
            data, damaged = None, True
            self._log_once("read", "not-regular", "disk tier: %s; it was removed and will be recomputed", error)
        except ValueError:
            data, damaged = None, True  # it changed length on disk
        except OSError as error:
            self._fault("read", error)
            data = None
        if data is not None and len(data) == entry.size:
            return data
        with self._lock:
            if self._lru.get(entry.key) is entry:  # not replaced meanwhile
                self._lru.remove(entry.key)
                self._unlink_locked(entry.key)
                if damaged or data is not None:
                    self._count_locked(rejected_records=1)
        return None

    def _lost_directory(self) -> None:
        """The directory itself is gone (deleted under a running server): forget every record, so
        used_bytes and the index say what is there, and write into a fresh directory from now on."""
        if self.directory.is_dir():
            return
        with self._lock:
            lost = self._lru.keys()
            for key in lost:
                self._lru.remove(key)
        if lost:
            self._log_once(
                "read",
                "directory-gone",
                "disk tier: %s was deleted; its %d records are forgotten and the tier starts over empty there",
                self.directory,
                len(lost),
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._fault("open", error)

    def _index_at_start(self, found: list[HeaderRead], report: RebuildReport) -> None:
        """Index the records start-up found, oldest first, evicting (and deleting) what exceeds the capacity."""
        with self._lock:
            for read in found:
                header = read.header
                admission = self._lru.insert_and_evict(
                    header.key, header.parent_key, read.file_size, self.capacity_bytes
                )
                for victim in admission.evicted:
                    self._unlink_locked(victim.key)
                if not admission.admitted:
                    self._unlink_locked(header.key)
                report.num_evicted += len(admission.evicted) + (not admission.admitted)
            self._count_locked(rejected_records=report.num_rejected, reclaimed_records=report.num_reclaimed)
            report.num_records, report.num_bytes = len(self._lru), self._lru.used_bytes

    def _log_start(self, report: RebuildReport) -> None:
        logger.info(
            "disk tier %s: %d records (%d bytes) indexed from headers in %.3f s; removed %d temporary, "
            "%d damaged, %d of another scope, %d over capacity",
            self.directory,
            report.num_records,
            report.num_bytes,
            report.seconds,
            report.num_temp_removed,
            report.num_rejected,
            report.num_reclaimed,
            report.num_evicted,
        )

    def _rejected_at_start(self, path: Path, reason: str, error: Optional[OSError]) -> None:
        if error is not None:
            self._fault("read", error)
        self._log_once(
            "startup", reason, "disk tier: deleted damaged records at start-up (first: %s, %s)", path, reason
        )

    def _unlink_locked(self, key: bytes) -> None:
        try:
            os.unlink(record_path(self.directory, key))
        except FileNotFoundError:
            pass
        except OSError as error:
            self._fault("delete", error)

    def _fault(self, operation: str, error: OSError) -> None:
        self._count(errors=1)
        kind = errno.errorcode.get(error.errno or 0, type(error).__name__)
        self._log_once(
            operation,
            kind,
            "disk tier: cannot %s under %s (%s); the tier drops what it cannot %s, counts it in stats.errors and "
            "keeps serving what it has. Fix: free space or make the directory writable (kv_disk_cache_dir).",
            operation,
            self.directory,
            error,
            operation,
        )

    def check_integrity(self) -> None:
        """Index == record files (names and sizes), no temporary file, byte count, leaf-first structure.

        Waits for the writes already queued first: a write in flight has a temporary file by design."""
        self.flush()
        with self._lock:
            assert not self._queued, f"{len(self._queued)} records still queued after flush"
            self._lru.check_integrity()
            assert self._lru.used_bytes <= self.capacity_bytes, "over capacity"
            files: dict[bytes, int] = {}
            if self.directory.is_dir():
                for entry in scan(self.directory):
                    assert not entry.is_temp, f"temporary file left behind: {entry.path}"
                    assert entry.key is not None, f"misnamed record file: {entry.path}"
                    files[entry.key] = entry.path.stat().st_size
            assert set(files) == set(self._lru.keys()), "index and files hold different keys"
            for key, size in files.items():
                assert self._lru.get(key).size == size, f"{key.hex()}: file is {size} bytes, index says otherwise"
