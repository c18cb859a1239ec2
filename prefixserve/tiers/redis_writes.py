"""The remote tier's write path (RedisWriter): store what Redis lacks, within the write cap.

One pipelined round trip asks which records Redis already holds (TYPE, and with a
TTL PEXPIRE, which renews a present record's TTL); the rest are encoded, passed
through the write cap (redis_rate.py) and SET in batches of at most PUT_BATCH_BYTES.
A record the cap refuses is dropped, and so is every record whose parent was.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from .record import BlockRecord
from .redis_calls import RedisCommands
from .redis_rate import TokenBucket

PUT_BATCH_BYTES = 8 << 20


class RedisWriter:
    """Writes records through the tier's commands: `name_of` a key (the tier's current scope), `encode` (sealed
    where the tier seals), the TTL, the rate cap. On a cluster a master that does not answer leaves None
    replies: its records are neither found nor stored (counted dropped)."""

    def __init__(
        self,
        commands: RedisCommands,
        name_of: Callable[[bytes], bytes],
        encode: Callable[[BlockRecord], bytes],
        ttl_ms: Optional[int],
        rate: Optional[TokenBucket],
        count: Callable[..., None],
        log_once: Callable[..., None],
    ) -> None:
        self._commands = commands
        self._name = name_of
        self.encode = encode
        self.ttl_ms = ttl_ms
        self._rate = rate
        self._count = count
        self._log_once = log_once

    def write(self, records: list[BlockRecord]) -> int:
        """Store what Redis lacks, within the rate cap; returns how many of `records` Redis now holds."""
        if not records:
            return 0
        # TYPE (and with a TTL PEXPIRE, which renews a present record's TTL): one round trip. A key holding
        # another type (a list planted under a record's name) is written over: SET replaces any type.
        replies = self._commands.pipeline(
            "put", [self._name(record.key) for record in records], self._touch, per_name=1 if self.ttl_ms is None else 2
        )
        if replies is None:
            self._count(dropped_puts=len(records))
            return 0
        kinds = replies[::2] if self.ttl_ms is not None else replies
        missing = [record for record, kind in zip(records, kinds) if kind not in (b"string", "string")]
        num_stored = len(records) - len(missing)
        batches = self._encode_within_cap(missing)
        for index, batch in enumerate(batches):
            data_of = dict(batch)
            replies = self._commands.pipeline(
                "put",
                [name for name, _ in batch],
                lambda pipe, name, data_of=data_of: pipe.set(name, data_of[name], px=self.ttl_ms),
            )
            if replies is None:
                self._count(dropped_puts=sum(len(rest) for rest in batches[index:]))
                break
            stored = [len(data) for (_, data), reply in zip(batch, replies) if reply is True]
            self._count(bytes_written=sum(stored), dropped_puts=len(batch) - len(stored))
            num_stored += len(stored)
        return num_stored

    def _encode_within_cap(self, records: list[BlockRecord]) -> list[list[tuple[bytes, bytes]]]:
        """(name, encoded record) in batches of at most PUT_BATCH_BYTES; what the rate cap refuses is dropped,
        and so is every record whose parent was, since it could never be part of a leading run."""
        batches: list[list[tuple[bytes, bytes]]] = []
        batch_bytes, dropped = PUT_BATCH_BYTES, set()
        for record in records:
            data = self.encode(record)
            if record.parent_key in dropped or (self._rate is not None and not self._rate.try_take(len(data))):
                dropped.add(record.key)
                continue
            if batch_bytes + len(data) > PUT_BATCH_BYTES:
                batches.append([])
                batch_bytes = 0
            batches[-1].append((self._name(record.key), data))
            batch_bytes += len(data)
        if dropped:
            self._count(dropped_puts=len(dropped))
            self._log_once(
                "put",
                "rate",
                "remote tier: the write cap (%d bytes/s) dropped records (counted in "
                "dropped_puts). Raise kv_remote_write_bytes_per_second if Redis and the network have room",
                self._rate.bytes_per_second if self._rate is not None else 0,
                level=logging.INFO,
            )
        return batches

    def _touch(self, pipe: Any, name: bytes) -> None:
        pipe.type(name)
        if self.ttl_ms is not None:
            pipe.pexpire(name, self.ttl_ms)
