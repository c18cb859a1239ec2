"""The fleet-shared remote tier: encoded records in Redis, readable by every replica of the same scope.

    key    pskv:<scope digest, hex>:<block key, hex>     in the URL's database
    value  an encoded record (record.py), verified by the reader like a disk read

Redis itself is the index; nothing is mirrored here, because other replicas write,
and Redis evicts (maxmemory) and expires (TTL) behind this process's back. So
`contains` asks Redis (one pipelined round trip of EXISTS per key), a key that
vanished between `contains` and `get` is a miss, and `used_bytes` and
`capacity_bytes` are Redis's used_memory and maxmemory. Every command names one
key, so none can fail with CROSSSLOT under Redis Cluster's per-key routing: on a
cluster (found by asking the server) the commands go to each key's master in one
pipeline per master, each master with a back-off of its own (redis_nodes.py).

Faults never reach the caller and never stall it past a timeout: a failed call
opens a back-off episode (redis_backoff.py) during which lookups miss and writes
are dropped at once; the episode is logged when it opens and when it closes.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from .base import KVTier, TierTraits
from .policy import TierCost
from .record import BlockRecord
from .redis_backoff import Backoff
from .redis_calls import BACKOFF_SECONDS, MemoryInfo, RedisCommands
from .redis_client import connect, memory_advice, redacted, require_redis
from .redis_nodes import connect_nodes
from .redis_rate import TokenBucket
from .redis_writes import RedisWriter
from .seal import Sealer
from .writer import BackgroundWriter

logger = logging.getLogger("prefixserve.tiers")

# A prior, refreshed by reads: a LAN round trip, and the 0.6-0.8 GB/s measured on localhost (redis-py bounds it).
REMOTE_READ_COST = TierCost(latency_seconds=5e-4, bytes_per_second=7e8)
MEMORY_INFO_SECONDS = 1.0  # INFO memory is asked at most this often
GET_BATCH_KEYS = 32  # per round trip: 8 MiB of 256 KiB records (8 to 32 equally fast here, 125 at once 15% slower)
DEFAULT_MAX_PENDING_BYTES = 64 << 20
KEY_PREFIX = b"pskv:"


class RedisTier(KVTier):
    """No write cap by default: on this machine Redis takes about 0.85 GB/s of put_async, a CPU replica at full
    prefill makes about 47 MB/s of KV, and the bounded queue already drops what Redis cannot take. A fleet of GPU
    replicas, whose write-through can fill the link its reads need, should set max_write_bytes_per_second."""

    name = "remote"
    traits = TierTraits(synchronous=False, write_through=True, shared=True)
    _memory = MemoryInfo(0, 0, float("-inf"))  # Redis's used and max memory, replaced by INFO at most once a second

    def __init__(
        self,
        url: str,
        *,
        scope_digest: bytes,
        ttl_seconds: Optional[float] = None,
        max_write_bytes_per_second: Optional[int] = None,
        connect_timeout: float = 0.5,
        read_timeout: float = 1.0,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        num_read_threads: int = 2,
        sealer: Optional[Sealer] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        redis = require_redis()
        super().__init__(0, TierCost(REMOTE_READ_COST.latency_seconds, REMOTE_READ_COST.bytes_per_second), sealer)
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive (or None: no expiry), got {ttl_seconds}")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got connect {connect_timeout}, read {read_timeout}")
        self.url = redacted(url)
        self.scope_digest = scope_digest
        self.ttl_ms = None if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self._prefix = KEY_PREFIX + scope_digest.hex().encode() + b":"
        self._response_error = redis.exceptions.ResponseError
        backoff = Backoff(BACKOFF_SECONDS, clock)  # tests step an injected clock past a back-off
        nodes = connect_nodes(
            connect(url, connect_timeout, read_timeout),
            url,
            connect_timeout,
            read_timeout,
            backoff,
            f"Redis at {self.url}",
            clock,
        )
        self._commands = RedisCommands(
            nodes,
            self.url,
            (url, connect_timeout, read_timeout, clock),
            backoff,
            (redis.RedisError, OSError),  # a call that raises these opens a back-off episode
            redis.exceptions.OutOfMemoryError,  # one command refused: Redis is full
            self._count,
            self._log_once,
        )
        rate = None if max_write_bytes_per_second is None else TokenBucket(max_write_bytes_per_second)
        self._writes = RedisWriter(
            self._commands, self._name, self.encode, self.ttl_ms, rate, self._count, self._log_once
        )
        self._pending_bytes = 0  # accepted by put_async, not yet written or dropped
        self._writer = BackgroundWriter(self._write_batch, max_pending_bytes, "prefixserve-remote-writer")
        self._readers = ThreadPoolExecutor(num_read_threads, thread_name_prefix="prefixserve-remote-reader")
        self._check_server()

    @property
    def is_cluster(self) -> bool:
        """Whether the URL's server is a Redis Cluster node (found by asking it, or by a MOVED reply)."""
        return self._commands.is_cluster

    # ------------------------------------------------------------------ reads
    def contains(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of `keys` in Redis: one pipelined round trip, whatever the length."""
        if not keys:
            return 0
        replies = self._commands.pipeline(
            "contains", [self._name(key) for key in keys], lambda pipe, name: pipe.exists(name)
        )
        run = 0
        for reply in replies or ():
            if reply != 1:  # 0, or an error reply: absent either way
                break
            run += 1
        return run

    def get(self, keys: Sequence[bytes]) -> list[Optional[bytes]]:
        """Records in pipelined batches; a read refreshes the record's TTL, so what is in use stays."""
        start = time.perf_counter()
        results: list[Optional[bytes]] = [None] * len(keys)
        for offset in range(0, len(keys), GET_BATCH_KEYS):
            batch = keys[offset : offset + GET_BATCH_KEYS]
            replies = self._commands.pipeline("get", [self._name(key) for key in batch], self._read)
            if replies is None:  # a fault: the rest would only wait for the same timeout
                break
            for index, reply in enumerate(replies):
                if isinstance(reply, bytes):
                    results[offset + index] = reply
                elif isinstance(reply, self._response_error) and "WRONGTYPE" in str(reply):
                    self.reject(batch[index], "magic")  # not a record: deleted, so the next write stores one
        return self._account_reads(results, start)

    def keys(self) -> list[bytes]:
        """Every key of this scope in Redis (SCAN: this replica's and every other's)."""
        names = self._commands.scan("keys", self._prefix)
        return [bytes.fromhex(name[len(self._prefix) :].decode("ascii")) for name in names or ()]

    @property
    def used_bytes(self) -> int:
        """Redis's used_memory (every scope's records and Redis's own overhead), at most a second old."""
        return self._memory_info().used_bytes

    @property
    def capacity_bytes(self) -> int:
        """Redis's maxmemory, at most a second old; 0 when Redis has no limit."""
        return self._memory_info().max_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:  # KVTier.__init__ sets it; Redis's INFO replaces it
        self._memory = self._memory._replace(max_bytes=value)

    # ----------------------------------------------------------------- writes
    def put(self, records: Sequence[BlockRecord]) -> None:
        self._writes.write(list(records))

    def _put_one(self, record: BlockRecord) -> bool:
        return self._writes.write([record]) == 1

    def _write_batch(self, records: list[BlockRecord]) -> None:
        """The writer thread's batch: written, then no longer pending whatever happened."""
        try:
            self._writes.write(records)
        finally:
            with self._lock:
                self._pending_bytes -= sum(len(record.payload) for record in records)

    def put_async(self, records: Sequence[BlockRecord]) -> None:
        """Queue records for the writer thread; never blocks. Dropped (and counted): what does not fit the
        queue, and everything while Redis is backing off."""
        backing_off = self._commands.all_backing_off
        num_accepted = 0 if backing_off else self._writer.submit(records)
        with self._lock:
            self._pending_bytes += sum(len(record.payload) for record in records[:num_accepted])
        if num_accepted < len(records):
            self._count(dropped_puts=len(records) - num_accepted)
            if not backing_off:
                self._log_once(
                    "queue",
                    "full",
                    "remote tier: write queue full (or closed); %d records dropped. "
                    "Redis or the network is slower than this replica's writes",
                    len(records) - num_accepted,
                )

    def flush(self) -> None:
        self._writer.flush()

    def delete(self, keys: Sequence[bytes]) -> None:
        for offset in range(0, len(keys), GET_BATCH_KEYS):
            batch = keys[offset : offset + GET_BATCH_KEYS]  # DEL per key: a multi-key DEL is CROSSSLOT on a cluster
            self._commands.pipeline("delete", [self._name(key) for key in batch], lambda pipe, name: pipe.delete(name))

    def purge_scope(self, scope_digest: bytes) -> int:
        """Delete every record of another scope (an old model version no replica serves any more);
        returns how many were found. Never this tier's own scope."""
        if scope_digest == self.scope_digest:
            raise ValueError("purge_scope deletes another scope's records, not the one this tier serves")
        prefix = KEY_PREFIX + scope_digest.hex().encode() + b":"
        names = self._commands.scan("purge", prefix) or []
        for offset in range(0, len(names), GET_BATCH_KEYS):
            batch = names[offset : offset + GET_BATCH_KEYS]  # DEL per key: a multi-key DEL is CROSSSLOT on a cluster
            self._commands.pipeline("purge", batch, lambda pipe, name: pipe.delete(name))
        return len(names)

    def rescope(self, scope_digest: bytes) -> Optional[int]:
        """Read and write another scope's keys from now on (a hot reload; flush first): the old scope's
        records stay for replicas still serving it (purge_scope removes them), so none is reclaimed."""
        with self._lock:
            self.scope_digest = scope_digest
            self._prefix = KEY_PREFIX + scope_digest.hex().encode() + b":"
        return None

    def close(self) -> None:
        self._writer.close()
        self._readers.shutdown(wait=True)
        self._commands.close()

    def check_integrity(self) -> None:
        """What can be checked here (Redis holds the rest): counters non-negative, nothing left to write.
        Call after `flush`, with no operation in flight."""
        with self._lock:
            for counter, value in vars(self._stats).items():
                assert value >= 0, f"stats.{counter} is {value}"
            assert self._pending_bytes == 0, f"{self._pending_bytes} bytes accepted by put_async are still unwritten"

    # ---------------------------------------------------------------- helpers
    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode("ascii")

    def _read(self, pipe: Any, name: bytes) -> Any:
        return pipe.get(name) if self.ttl_ms is None else pipe.getex(name, px=self.ttl_ms)

    def _memory_info(self) -> MemoryInfo:
        with self._lock:
            memory = self._memory
            if time.monotonic() - memory.read_at < MEMORY_INFO_SECONDS:
                return memory
            self._memory = memory._replace(read_at=time.monotonic())  # one asker per second, even on a fault
        info = self._read_memory("info")
        return memory if info is None else self._memory

    def _read_memory(self, operation: str) -> Optional[dict]:
        """INFO memory of every server, summed; remembered as the tier's used and maximum bytes."""
        total = self._commands.read_memory(operation)
        if total is not None:
            with self._lock:
                self._memory = MemoryInfo(total["used_memory"], total["maxmemory"], time.monotonic())
        return total

    def _check_server(self) -> None:
        """Warn about Redis settings that make it a poor cache (a Redis that is down opens an episode instead)."""
        info = self._read_memory("start")
        advice = None if info is None else memory_advice(info, self.ttl_ms is not None)
        if advice is not None:
            logger.warning("remote tier: Redis at %s %s", self.url, advice)
