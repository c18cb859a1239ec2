"""Time reads of real KV records from each tier (host, cold disk, and a Redis given by URL): what `plan tiers`
prices and `simulate --calibrate` writes into the fleet's cost model.

A chain of records of the model's block shape is written to a tier, then runs of READ_SIZES_BLOCKS blocks are
read back through the tier's get and the record check (the seal's too, with a secret), READ_REPEATS times each;
latency and bandwidth are fitted to the medians (plan/tiers.fit_read_cost). The remote tier's records are
deleted afterwards; they live under a scope of their own (SCOPE), so no replica's KV is touched.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ..tiers.policy import TierCost

READ_SIZES_BLOCKS = (1, 8, 32, 125)  # runs timed per tier: 125 blocks of 16 are the 2,000-token reference prefix
READ_REPEATS = 5
SCOPE = hashlib.sha256(b"prefixserve plan tiers").digest()  # the records' scope: no model's, no tenant's


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-remote-url and --kv-tier-secret-file, as `prefixserve serve` takes them, for timing the remote tier."""
    parser.add_argument(
        "--kv-remote-url",
        metavar="URL",
        help="also time reads from this Redis (redis:// or rediss://, one server or a cluster), as "
        "'serve --kv-remote-url' reads it; the timed records are deleted afterwards (default: "
        "none, the remote tier keeps its stated cost)",
    )
    parser.add_argument(
        "--kv-tier-secret-file",
        metavar="FILE",
        help="with --kv-remote-url: seal the timed records with this secret and verify each read, "
        "as a fleet with this file does (default: none, unsealed records)",
    )


def remote_assumption(url: Optional[str], secret_file: Optional[str]) -> str:
    if url is None:
        return "remote: not timed (give --kv-remote-url)"
    from ..tiers.redis_client import redacted

    return (
        f"remote: {redacted(url)}, records {'sealed and verified' if secret_file else 'unsealed'}; latency and "
        f"bandwidth of this client and network, not of another machine's"
    )


def measure_tier_reads(
    block_shape: tuple[int, ...],
    dtype: str,
    disk_dir: Optional[str],
    remote_url: Optional[str] = None,
    secret_file: Optional[str] = None,
) -> dict:
    """Tier name -> TierCost for host, cold disk and (given a URL) the remote tier; ValueError when the remote
    tier cannot be written or read (Redis down, a wrong URL or password)."""
    from ..plan.tiers import fit_read_cost
    from ..tiers import BlockRecord, DiskTier, HostTier, Keyring, RecordExpectation, Sealer, decode_record
    from ..tiers.disk_files import record_path
    from ..tiers.record import DTYPE_SIZES

    if secret_file is not None and remote_url is None:
        raise ValueError("--kv-tier-secret-file seals the remote tier's timed records; give --kv-remote-url too")
    sealer = None if secret_file is None else Sealer(Keyring.from_file(secret_file))
    block_size, block_bytes = block_shape[2], math.prod(block_shape) * DTYPE_SIZES[dtype]
    records, parent = [], None
    for index in range(max(READ_SIZES_BLOCKS)):
        key = hashlib.sha256(SCOPE + index.to_bytes(4, "little")).digest()
        records.append(
            BlockRecord(
                key,
                parent,
                SCOPE,
                tuple(range(index * block_size, (index + 1) * block_size)),
                dtype,
                block_shape,
                os.urandom(block_bytes),
            )
        )
        parent = key
    capacity = 2 * len(records) * (block_bytes + 4096)

    def time_reads(tier, before_each=None, tier_sealer=None) -> TierCost:
        def once(chosen: list[BlockRecord]) -> float:
            if before_each is not None:
                before_each(chosen)
            start = time.perf_counter()
            for record, data in zip(chosen, tier.get([record.key for record in chosen])):
                if data is None:
                    raise ValueError(f"the {tier.name} tier lost a record it had just stored; time it again")
                decode_record(
                    data, RecordExpectation(record.key, SCOPE, record.token_ids, dtype, block_shape), tier_sealer
                )
            return time.perf_counter() - start

        samples = [
            (size * block_bytes, statistics.median(once(records[:size]) for _ in range(READ_REPEATS)))
            for size in READ_SIZES_BLOCKS
        ]
        return fit_read_cost(samples)

    costs = {}
    with HostTier(capacity) as host:
        host.put(records)
        costs["host"] = time_reads(host)
    with tempfile.TemporaryDirectory(prefix="prefixserve-plan-", dir=disk_dir) as directory:

        def drop_page_cache(chosen: list[BlockRecord]) -> None:
            if not hasattr(os, "posix_fadvise"):
                return
            for record in chosen:  # a cold read: fsynced pages are clean, so this drops them
                fd = os.open(record_path(Path(directory), record.key), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        with DiskTier(directory, capacity, expect_scope=SCOPE) as disk:
            disk.put(records)
            costs["disk"] = time_reads(disk, drop_page_cache)
    if remote_url is not None:
        costs["remote"] = _time_remote(remote_url, sealer, records, time_reads)
    return costs


def _time_remote(url: str, sealer, records: list, time_reads: Callable[..., TierCost]) -> TierCost:
    from ..tiers.redis import RedisTier
    from ..tiers.redis_client import redacted

    with RedisTier(url, scope_digest=SCOPE, sealer=sealer, read_timeout=10.0) as remote:
        try:
            remote.put(records)
            if remote.contains([record.key for record in records]) != len(records):
                raise ValueError(
                    f"--kv-remote-url {redacted(url)}: the timed records could not be written (is "
                    f"Redis up, the URL and password right, maxmemory large enough?)"
                )
            return time_reads(remote, tier_sealer=sealer)
        finally:
            remote.delete([record.key for record in records])
