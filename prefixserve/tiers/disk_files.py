"""How the disk tier lays records out in files, writes them atomically and reads their headers.

    <directory>/
        .lock                      held (flock) by the process serving the directory
        3f/                        shard: the key's first byte in hex
            3fa0...9c.kv           one record, named by its key
            3fa0...9c.kv.<pid>.<n>.tmp   a write in progress (or left by a crash)

A record is written to its temporary name, fsynced, then renamed over its final
name: a reader, or a restart after a kill, sees the whole record or none. (The
directory itself is not fsynced after the rename, so a power cut may lose the
newest records, never half of one.)

Nothing here can block on what it opens: files are opened non-blocking and
without following a symlink, and only a regular file is read (a FIFO or device
planted under a record's name is refused at once). A medium that hangs anyway
(a dead NFS server) is the engine's deadline's business (engine/kv_tiers.py).
"""

from __future__ import annotations

import itertools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .record import FIXED_HEADER_SIZE, RecordHeader, header_length, read_header

RECORD_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
_HEX = frozenset("0123456789abcdef")
_temp_counter = itertools.count()


def record_path(directory: Path, key: bytes) -> Path:
    name = key.hex()
    return directory / name[:2] / (name + RECORD_SUFFIX)


def key_of(path_name: str) -> Optional[bytes]:
    """The key a record file is named by; None for a name this tier did not write."""
    if not path_name.endswith(RECORD_SUFFIX):
        return None
    stem = path_name[: -len(RECORD_SUFFIX)]
    if len(stem) < 2 or len(stem) % 2 or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


def write_temp_file(path: Path, data: bytes) -> Path:
    """Write `data` beside `path` under a temporary name and fsync it; the caller renames it into place."""
    path.parent.mkdir(exist_ok=True)
    temp = path.with_name(f"{path.name}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_quietly(temp)
        raise
    os.close(fd)
    return temp


class NotARecordFile(OSError):
    """Something other than a regular file under a record's name (a FIFO, a device, a symlink)."""


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at `path` and its status; NotARecordFile for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if error.errno == getattr(os, "ELOOP", None) or path.is_symlink():
            raise NotARecordFile(f"{path} is a symbolic link, not a record file") from None
        raise
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise NotARecordFile(f"{path} is not a regular file (mode {stat.filemode(status.st_mode)})")
    return fd, status


def read_file(path: Path, expected_size: Optional[int] = None) -> bytes:
    """A record file's bytes; None-free: raises OSError (NotARecordFile for a non-regular file) and
    ValueError when the file is not `expected_size` bytes long (read no further)."""
    fd, status = open_regular(path)
    try:
        if expected_size is not None and status.st_size != expected_size:
            raise ValueError(f"{path} is {status.st_size} bytes, its index entry {expected_size}")
        chunks, remaining = [], status.st_size
        while remaining > 0:
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass(frozen=True)
class HeaderRead:
    header: RecordHeader
    file_size: int
    mtime_ns: int
    num_bytes_read: int  # header bytes only: the payload is never read here


def read_header_file(path: Path) -> HeaderRead:
    """The header of a record file, from exactly its header bytes (unbuffered, two reads).

    Raises RecordError for a damaged header and OSError for a file that cannot be read.
    """
    fd, status = open_regular(path)
    try:
        fixed = os.read(fd, FIXED_HEADER_SIZE)
        length = header_length(fixed)
        rest = os.read(fd, length - len(fixed))
    finally:
        os.close(fd)
    data = fixed + rest
    return HeaderRead(read_header(data), status.st_size, status.st_mtime_ns, len(data))


@dataclass(frozen=True)
class ScanEntry:
    path: Path
    is_temp: bool
    key: Optional[bytes]  # None for a temporary file or a name this tier did not write


def scan(directory: Path) -> Iterator[ScanEntry]:
    """Record and temporary files under the shard folders (anything else is left alone)."""
    with os.scandir(directory) as shards:
        for shard in shards:
            if len(shard.name) != 2 or not _HEX.issuperset(shard.name) or not shard.is_dir(follow_symlinks=False):
                continue
            with os.scandir(shard.path) as files:
                for file in files:
                    if not file.is_file(follow_symlinks=False):
                        continue  # a FIFO, device, socket, symlink or folder: never a record (never opened)
                    if file.name.endswith(TEMP_SUFFIX):
                        yield ScanEntry(Path(file.path), True, None)
                    elif file.name.endswith(RECORD_SUFFIX):
                        yield ScanEntry(Path(file.path), False, key_of(file.name))
