"""What a disk tier does before it serves: lock its directory, clear crash leftovers, read the headers.

Only headers are read (record.FIXED_HEADER_SIZE bytes, then the rest of the
header), never a payload, so a restart over N records costs 2N small reads. A
record is kept only when its header is sound, its file name is its key, its file
is exactly as long as its header says (a torn or truncated write fails this) and,
when the tier expects a scope, it is of that scope: a new model version or
tokenizer reclaims the old records before serving. `open_directory` runs these
steps and returns what it found; DiskTier indexes what fits its capacity.
"""

from __future__ import annotations

import logging
import os
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


@dataclass
class OpenedDirectory:
    """What `open_directory` leaves for the tier: the lock it holds, whether it may write, the records found."""

    lock_fd: Optional[int]  # the flock's descriptor (None: no flock on this system, or not taken)
    can_write: bool  # False when another process serves the directory
    found: Optional[list[HeaderRead]]  # sound records of this scope, oldest first; None when it could not be read
    report: RebuildReport


def open_directory(
    directory: Path,
    expect_scope: Optional[bytes],
    on_fault: Callable[[str, OSError], None],
    on_rejected: OnRejected,
) -> OpenedDirectory:
    """Create or lock the directory, remove crash leftovers, read the headers of this scope's records.

    A directory another process serves is refused (nothing read, nothing written); one without flock is served
    unguarded; a fault is handed to `on_fault` (operation, error) and leaves nothing found."""
    report = RebuildReport()
    lock_fd = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            lock_fd = lock_directory(directory)
        except BlockingIOError:
            logger.error(
                "disk tier: %s is already served by another process (or another DiskTier); this one stores "
                "nothing. Fix: give each server its own kv_disk_cache_dir.",
                directory,
            )
            return OpenedDirectory(None, False, None, report)
        except OSError as error:  # a read-only directory or a file system without flock: serve unguarded
            on_fault("lock", error)
        found = read_headers(directory, expect_scope, report, on_rejected)
    except OSError as error:
        on_fault("open", error)
        return OpenedDirectory(lock_fd, True, None, report)
    return OpenedDirectory(lock_fd, True, found, report)
