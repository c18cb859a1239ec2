"""The disk tier: atomic files, warm restart from headers, reclaiming other scopes, eviction, faults, threads."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tier_helpers import OTHER_SCOPE, SCOPE, expect, make_chain, run_in_threads, size

from prefixserve.tiers import DiskTier, RecordError, decode_record, encode_record
from prefixserve.tiers.disk_files import record_path
from prefixserve.tiers.record import header_length

BIG = 1 << 30


def files_under(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file() and path.name != ".lock")


def writes_are_refused(directory: Path) -> bool:
    """chmod does not stop root (CAP_DAC_OVERRIDE); find out whether it stops this process."""
    try:
        (directory / "probe").write_bytes(b"")
    except PermissionError:
        return True
    (directory / "probe").unlink()
    return False


@pytest.fixture
def chain():
    return make_chain(list(range(16)))  # 4 blocks


def test_put_get_and_files(tmp_path, chain):
    with DiskTier(tmp_path, BIG, expect_scope=SCOPE) as tier:
        tier.put(chain)
        assert tier.contains([r.key for r in chain]) == 4
        results = tier.get([chain[1].key, b"absent"])
        assert decode_record(results[0], expect(chain[1])) == chain[1] and results[1] is None
        assert tier.fetch([chain[3].key]).result() == [encode_record(chain[3])]
        assert files_under(tmp_path) == sorted(record_path(tmp_path, r.key) for r in chain)
        assert tier.used_bytes == sum(size(r) for r in chain) == tier.stats.bytes_written
        assert (tier.stats.hits, tier.stats.misses) == (2, 1)
        tier.check_integrity()


def test_restart_rebuilds_the_index_from_headers_only(tmp_path, chain):
    with DiskTier(tmp_path, BIG, expect_scope=SCOPE) as tier:
        tier.put(chain)
    # Overwrite every payload with garbage of the same length: a rebuild that read payloads
    # (or checked the record checksum) would notice; this one must not.
    header_bytes = 0
    for record in chain:
        path = record_path(tmp_path, record.key)
        data = path.read_bytes()
        header_bytes += header_length(data)
        path.write_bytes(data[: header_length(data)] + b"\xee" * (len(data) - header_length(data)))
    with DiskTier(tmp_path, BIG, expect_scope=SCOPE) as tier:
        report = tier.rebuild_report
        assert (report.num_records, report.num_rejected, report.num_reclaimed) == (4, 0, 0)
        assert report.num_header_bytes_read == header_bytes  # exactly the headers, not one payload byte
        assert tier.contains([r.key for r in chain]) == 4
        data = tier.get([chain[0].key])[0]
        with pytest.raises(RecordError) as caught:
            decode_record(data, expect(chain[0]))
        assert caught.value.reason == "checksum"  # the reader's check is where damaged payloads are caught
        tier.reject(chain[0].key, caught.value.reason)
        assert tier.contains([r.key for r in chain]) == 0 and tier.stats.rejected_records == 1
        tier.check_integrity()


def test_restart_serves_what_was_written_and_close_flushes(tmp_path, chain):
    tier = DiskTier(tmp_path, BIG, expect_scope=SCOPE)
    tier.put_async(chain)
    tier.close()  # no flush: close writes what is queued
    with DiskTier(tmp_path, BIG, expect_scope=SCOPE) as tier:
        assert [decode_record(d, expect(r)) for d, r in zip(tier.get([r.key for r in chain]), chain)] == chain
        tier.check_integrity()


def test_crash_leftovers_are_removed_at_start(tmp_path, chain, caplog):
    """A kill mid-write leaves a temporary file (never a half record under the final name); a file
    truncated or damaged some other way, or copied in under another record's name, is deleted and counted."""
    with DiskTier(tmp_path, BIG) as tier:
        tier.put(chain)
    paths = [record_path(tmp_path, r.key) for r in chain]
    temp = paths[0].with_name(paths[0].name + ".4242.7.tmp")
    temp.write_bytes(paths[0].read_bytes()[:100])
    paths[1].write_bytes(paths[1].read_bytes()[:-10])  # truncated in the payload: header fine, size wrong
    damaged = bytearray(paths[2].read_bytes())
    damaged[40] ^= 0xFF  # in the header
    paths[2].write_bytes(bytes(damaged))
    stray = record_path(tmp_path, b"\x77" * 32)
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(paths[3].read_bytes())  # a valid record under the wrong name
    with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
        tier = DiskTier(tmp_path, BIG)
    report = tier.rebuild_report
    assert (report.num_temp_removed, report.num_rejected, report.num_records) == (1, 3, 2)
    assert tier.stats.rejected_records == 3
    assert tier.contains([r.key for r in chain]) == 1 and tier.contains([chain[3].key]) == 1
    assert not temp.exists() and not paths[1].exists() and not paths[2].exists() and not stray.exists()
    assert any("damaged records at start-up" in r.getMessage() for r in caplog.records)
    tier.check_integrity()
    tier.close()


def test_other_scope_records_are_reclaimed_at_start(tmp_path, chain):
    other = make_chain(list(range(16)), scope=OTHER_SCOPE)
    with DiskTier(tmp_path, BIG) as tier:  # no expectation: holds both
        tier.put(chain + other)
        assert len(tier.keys()) == 8
    with DiskTier(tmp_path, BIG, expect_scope=OTHER_SCOPE) as tier:  # "a new model version"
        assert tier.rebuild_report.num_reclaimed == 4 and tier.stats.reclaimed_records == 4
        assert set(tier.keys()) == {r.key for r in other}
        assert files_under(tmp_path) == sorted(record_path(tmp_path, r.key) for r in other)
        tier.check_integrity()


def test_tiny_capacity_evicts_leaf_first_and_deletes_files(tmp_path):
    prefix = list(range(8))
    p0, p1, a2 = make_chain(prefix + [100, 101, 102, 103])
    b2 = make_chain(prefix + [200, 201, 202, 203])[2]
    c0 = make_chain(list(range(300, 304)))[0]
    with DiskTier(tmp_path, size(p0) + size(p1) + size(a2) + size(b2)) as tier:
        tier.put([p0, p1, a2, b2])
        tier.put([c0])  # leaves a2, b2, c0: a2
        assert set(tier.keys()) == {p0.key, p1.key, b2.key, c0.key}
        tier.get([b2.key])
        tier.put([a2])  # leaves b2 (just read), c0, a2: c0
        assert set(tier.keys()) == {p0.key, p1.key, a2.key, b2.key}
        assert not record_path(tmp_path, c0.key).exists()
        assert tier.stats.evictions == 2
        tier.check_integrity()


def test_restart_keeps_recency_from_file_times(tmp_path):
    """The index is rebuilt oldest file first, so a smaller capacity after a restart evicts the oldest leaves."""
    chains = [make_chain(list(range(100 * i, 100 * i + 4))) for i in range(4)]  # four one-block chains
    with DiskTier(tmp_path, BIG) as tier:
        for records in chains:
            tier.put(records)
    for age, records in zip((40, 10, 30, 20), chains):  # seconds in the past: chain 0 is the oldest
        path = record_path(tmp_path, records[0].key)
        stamp = path.stat().st_mtime_ns - age * 1_000_000_000
        os.utime(path, ns=(stamp, stamp))
    with DiskTier(tmp_path, 2 * size(chains[0][0])) as tier:
        assert tier.rebuild_report.num_evicted == 2
        assert set(tier.keys()) == {chains[1][0].key, chains[3][0].key}
        tier.check_integrity()


def test_put_async_then_flush(tmp_path):
    chains = [make_chain(list(range(100 * i, 100 * i + 12))) for i in range(10)]
    with DiskTier(tmp_path, BIG) as tier:
        for records in chains:
            tier.put_async(records)
        tier.flush()
        assert len(tier.keys()) == 30 and len(files_under(tmp_path)) == 30
        tier.check_integrity()


def test_a_full_write_queue_drops_and_counts_without_blocking(tmp_path, chain):
    with DiskTier(tmp_path, BIG, max_pending_bytes=2 * len(chain[0].payload)) as tier:
        release = threading.Event()
        started = threading.Event()
        write = tier._writer._write

        def held_write(records):
            started.set()
            release.wait()
            write(records)

        tier._writer._write = held_write
        tier.put_async(chain[:1])
        started.wait()  # the writer holds chain[0]: one payload pending
        tier.put_async(chain[1:])  # room for one more payload: chain[1] queued, chain[2:] dropped
        assert tier.stats.dropped_puts == 2
        release.set()
        tier.flush()
        assert set(tier.keys()) == {chain[0].key, chain[1].key}
        tier.check_integrity()


def test_a_record_queued_for_the_writer_is_served_from_memory(tmp_path, chain):
    """Read your writes: while the disk lags, what put_async accepted is still found; a dropped one is not."""
    with DiskTier(tmp_path, BIG, max_pending_bytes=3 * len(chain[0].payload)) as tier:
        release = threading.Event()
        write = tier._writer._write
        tier._writer._write = lambda records: (release.wait(), write(records))
        keys = [record.key for record in chain]
        tier.put_async(chain)  # room for three payloads: chain[3:] dropped
        assert tier.contains(keys) == 3
        assert tier.keys() == [] and files_under(tmp_path) == []  # nothing on disk yet
        assert tier.get(keys) == [encode_record(record) for record in chain[:3]] + [None]
        assert tier.stats.hits == 3 and tier.read_cost.num_observations == 0  # memory does not time the disk
        tier.delete([chain[2].key])
        assert tier.contains(keys) == 2
        release.set()
        tier.flush()
        assert tier.get([chain[0].key]) == [encode_record(chain[0])]  # now from its file
        assert tier.read_cost.num_observations == 1
        assert set(tier.keys()) == {chain[0].key, chain[1].key}  # chain[2] was deleted before the writer began it
        tier.check_integrity()


def test_full_disk_drops_counts_and_logs_once(tmp_path, chain, monkeypatch, caplog):
    with DiskTier(tmp_path, BIG) as tier:
        tier.put(chain[:2])

        def no_space(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("prefixserve.tiers.disk.write_temp_file", no_space)
        with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
            tier.put(chain[2:3])
            tier.put_async(chain[3:])
            tier.flush()
        assert (tier.stats.errors, tier.stats.dropped_puts) == (2, 2)
        assert len([r for r in caplog.records if "ENOSPC" in r.getMessage() or "No space" in r.getMessage()]) == 1
        assert tier.contains([r.key for r in chain]) == 2  # still serving what it has
        assert all(data is not None for data in tier.get([chain[0].key, chain[1].key]))
        tier.check_integrity()


def test_read_only_directory(tmp_path, chain, caplog):
    with DiskTier(tmp_path, BIG) as tier:
        tier.put(chain[:2])
    directories = [tmp_path] + [path for path in tmp_path.iterdir() if path.is_dir()]
    for directory in directories:
        directory.chmod(0o555)
    try:
        refused = writes_are_refused(tmp_path)
        if refused:
            with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
                with DiskTier(tmp_path, BIG) as tier:
                    assert tier.contains([r.key for r in chain]) == 2  # restart serves what is there
                    tier.put(chain[2:3])
                    tier.put(chain[3:])
                    assert tier.stats.dropped_puts == 2 and tier.stats.errors == 2
                    assert all(data is not None for data in tier.get([chain[0].key, chain[1].key]))
            assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    finally:
        for directory in directories:
            directory.chmod(0o755)
    if not refused:
        rerun_without_root_override(tmp_path / "unprivileged")


def rerun_without_root_override(basetemp: Path) -> None:
    """As root, chmod does not stop writes (CAP_DAC_OVERRIDE). A new user namespace with no uid
    mapping keeps our uid for file checks but drops the override, so the test reruns there;
    where that is not allowed, test_a_path_in_the_way still covers a write fault."""
    if os.environ.get("PREFIXSERVE_TIERS_RERUN") or shutil.which("unshare") is None:
        pytest.skip("chmod 0o555 does not stop writes here and no unprivileged rerun is possible")
    if subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode != 0:
        pytest.skip("chmod 0o555 does not stop this root process and user namespaces are not allowed")
    result = subprocess.run(
        [
            "unshare",
            "-U",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={basetemp}",
            f"{__file__}::test_read_only_directory",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "PREFIXSERVE_TIERS_RERUN": "1"},
    )
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr


def test_a_path_in_the_way(tmp_path, chain):
    """A fault that stops root too: the shard folder a new record needs is a regular file."""
    with DiskTier(tmp_path, BIG) as tier:
        tier.put(chain[:1])
        blocked = make_chain(list(range(1000, 1004)))[0]
        shard = record_path(tmp_path, blocked.key).parent
        assert not shard.exists()
        shard.write_bytes(b"not a folder")
        tier.put([blocked])
        assert (tier.stats.errors, tier.stats.dropped_puts) == (1, 1)
        assert tier.contains([blocked.key]) == 0 and tier.contains([chain[0].key]) == 1
        shard.unlink()
        tier.check_integrity()


def test_a_directory_that_cannot_exist_never_raises(tmp_path, chain):
    (tmp_path / "file").write_bytes(b"")
    with DiskTier(tmp_path / "file" / "kv", BIG) as tier:  # its parent is a file
        tier.put(chain)
        tier.put_async(chain)
        tier.flush()
        assert tier.get([chain[0].key]) == [None] and tier.contains([chain[0].key]) == 0
        assert (
            tier.stats.dropped_puts == 8 and tier.stats.errors == 3
        )  # the open, then the first record of each put (its children follow it out)
        tier.check_integrity()


def test_a_directory_is_served_by_one_tier_at_a_time(tmp_path, chain, caplog):
    with DiskTier(tmp_path, BIG) as first:
        first.put(chain[:1])
        with caplog.at_level(logging.ERROR, logger="prefixserve.tiers"):
            second = DiskTier(tmp_path, BIG)
        assert any("already served" in r.getMessage() for r in caplog.records)
        second.put(chain[1:])
        assert second.stats.dropped_puts == 3 and second.keys() == []
        second.close()
        assert first.contains([chain[0].key]) == 1  # the refused tier touched nothing
    with DiskTier(tmp_path, BIG) as third:  # released on close
        assert third.keys() == [chain[0].key]


def test_files_changed_behind_the_tier_are_misses(tmp_path, chain):
    with DiskTier(tmp_path, BIG) as tier:
        tier.put(chain)
        record_path(tmp_path, chain[0].key).unlink()
        record_path(tmp_path, chain[1].key).write_bytes(b"short")
        assert tier.get([r.key for r in chain[:3]])[:2] == [None, None]
        assert tier.stats.rejected_records == 1  # the changed length; the vanished file is a plain miss
        assert set(tier.keys()) == {chain[2].key, chain[3].key}
        tier.check_integrity()


def test_concurrent_puts_gets_and_async_puts(tmp_path):
    num_threads = 4
    chains = [make_chain([t * 10_000 + c * 100 + i for i in range(12)]) for t in range(num_threads) for c in range(6)]
    shared = make_chain(list(range(12)))
    capacity = 25 * size(shared[1])  # less than the 75 records put
    with DiskTier(tmp_path, capacity) as tier:
        barrier = threading.Barrier(num_threads)

        def work(thread: int) -> None:
            barrier.wait()
            for records in chains[thread * 6 : (thread + 1) * 6]:
                (tier.put_async if thread % 2 else tier.put)(records)
                tier.put(shared)
                for record, data in zip(records + shared, tier.fetch([r.key for r in records + shared]).result()):
                    if data is not None:
                        assert decode_record(data, expect(record)) == record

        failures = run_in_threads(work, range(num_threads))
        tier.flush()
        assert failures == []
        tier.check_integrity()
        assert tier.used_bytes <= capacity and tier.stats.errors == 0
