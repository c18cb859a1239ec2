"""What a disk tier does before it serves: lock its directory, clear crash leftovers, read the headers.

Only headers are read (record.FIXED_HEADER_SIZE bytes, then the rest of the
header), never a payload, so a restart over N records costs 2N small reads. A
record is kept only when its header is sound, its file name is its key, its file
is exactly as long as its header says (a torn or truncated write fails this) and,
when the tier expects a scope, it is of that scope: a new model version or
tokenizer reclaims the old records before serving. DiskStartup, mixed into DiskTier,
runs these steps and indexes what fits the tier's capacity.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .disk_files import LOCK_NAME, HeaderRead, read_header_file, remove_quietly, scan
from .record import RecordError

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process guard
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("prefixserve.tiers")

OnRejected = Callable[[Path, str, Optional[OSError]], None]  # path, RecordError reason or "unreadable", the error


@dataclass
class RebuildReport:
    """What start-up found in the directory."""

    num_records: int = 0  # indexed
    num_bytes: int = 0
    num_temp_removed: int = 0  # writes a crash left behind
    num_rejected: int = 0  # damaged, truncated or misnamed: deleted
    num_reclaimed: int = 0  # another scope's: deleted
    num_evicted: int = 0  # over capacity: deleted
    num_header_bytes_read: int = 0  # the whole I/O of the rebuild: no payload is read
    seconds: float = 0.0


def lock_directory(directory: Path) -> Optional[int]:
    """A descriptor holding an exclusive flock on the directory (None where there is no flock).

    Raises BlockingIOError while another holder has it, OSError when the lock cannot be taken at all.
    """
    if fcntl is None:
        return None
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_headers(
    directory: Path, expect_scope: Optional[bytes], report: RebuildReport, on_rejected: OnRejected
) -> list[HeaderRead]:
    """Headers of the sound records of this scope, oldest file first; everything else is deleted and counted."""
    found: list[HeaderRead] = []
    for entry in scan(directory):
        if entry.is_temp:
            remove_quietly(entry.path)
            report.num_temp_removed += 1
            continue
        reason, error = None, None
        try:
            read = read_header_file(entry.path)
            report.num_header_bytes_read += read.num_bytes_read
        except RecordError as record_error:
            reason = record_error.reason
        except OSError as os_error:
            reason, error = "unreadable", os_error
        else:
            if entry.key != read.header.key:
                reason = "key"  # misnamed: copied in under another record's name
            elif read.file_size != read.header.record_length:
                reason = "truncated"
        if reason is not None:
            remove_quietly(entry.path)
            report.num_rejected += 1
            on_rejected(entry.path, reason, error)
        elif expect_scope is not None and read.header.scope_digest != expect_scope:
            remove_quietly(entry.path)
            report.num_reclaimed += 1
        else:
            found.append(read)
    found.sort(key=lambda read: (read.mtime_ns, read.header.key))  # oldest first: recency survives a restart
    return found


class DiskStartup:
    """DiskTier's start-up (a mixin of it): lock the directory, read the headers, index what fits.

    It works on what DiskTier and KVTier hold: `directory`, `expect_scope`,
    `capacity_bytes`, `_lock`, `_lru`, `_lock_fd`, `_can_write`, the counters, and the
    tier's `_fault`, `_unlink_locked` and `_log_once`.
    """

    def _open(self) -> RebuildReport:
        """Create or lock the directory, remove crash leftovers, index the headers of this scope's records."""
        start = time.perf_counter()
        report = RebuildReport()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not self._lock_directory():
                self._can_write = False
                return report
            found = read_headers(self.directory, self.expect_scope, report, self._rejected_at_start)
        except OSError as error:
            self._fault("open", error)
            return report
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
        report.seconds = time.perf_counter() - start
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
        return report

    def _lock_directory(self) -> bool:
        """Hold the directory's flock; False when another process (or DiskTier) serves it."""
        try:
            self._lock_fd = lock_directory(self.directory)
        except BlockingIOError:
            logger.error(
                "disk tier: %s is already served by another process (or another DiskTier); this one stores "
                "nothing. Fix: give each server its own kv_disk_cache_dir.",
                self.directory,
            )
            return False
        except OSError as error:  # a read-only directory or a file system without flock: serve unguarded
            self._fault("lock", error)
        return True

    def _rejected_at_start(self, path: Path, reason: str, error: Optional[OSError]) -> None:
        if error is not None:
            self._fault("read", error)
        self._log_once(
            "startup", reason, "disk tier: deleted damaged records at start-up (first: %s, %s)", path, reason
        )
