"""The remote tier when Redis misbehaves: down at start, killed mid-run, stalled, full, or holding damaged
records. Every call returns misses or drops writes within a bounded time, never raises, counts the fault,
logs one line per episode, and the tier serves again once Redis answers."""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable

import pytest
from redis_helpers import (
    SCOPE,
    RedisServer,
    expect,
    keys_of,
    make_chain,
    redis_name,
    redis_server,  # noqa: F401  (a fixture)
)

from prefixserve.tiers import RecordError, decode_record, encode_record

pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")
from prefixserve.tiers.redis import BACKOFF_SECONDS, RedisTier  # noqa: E402

BOUND_SECONDS = 5.0  # generous: a call must return, not wait for Redis (behaviour, not speed)


def bounded(call: Callable, *args, **kwargs):
    start = time.monotonic()
    result = call(*args, **kwargs)
    assert time.monotonic() - start < BOUND_SECONDS, f"{call.__name__} took {time.monotonic() - start:.2f} s"
    return result


def wait_until_served(tier: RedisTier, chain, timeout: float = 10.0, step_clock: Callable = lambda: None) -> None:
    """Write and look up until Redis has the chain again (the back-off lets one probe through a second;
    `step_clock` moves an injected clock past it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step_clock()
        bounded(tier.put, chain)
        if bounded(tier.contains, keys_of(chain)) == len(chain):
            return
        time.sleep(0.1)
    raise AssertionError(f"the tier did not serve again within {timeout} s")


def put_to_sleep(port: int, seconds: int) -> socket.socket:
    """DEBUG SLEEP on a raw connection, returning once Redis is asleep (a PING goes unanswered)."""
    sleeper = socket.create_connection(("127.0.0.1", port))
    sleeper.sendall(f"DEBUG SLEEP {seconds}\r\n".encode())
    with socket.create_connection(("127.0.0.1", port), timeout=0.1) as probe:
        for _ in range(50):
            probe.sendall(b"PING\r\n")
            try:
                probe.recv(16)
            except socket.timeout:
                return sleeper
    raise AssertionError("Redis did not go to sleep")


def episode_lines(caplog) -> tuple[int, int]:
    return caplog.text.count(" failed during "), caplog.text.count(" answers again after ")


def test_redis_down_at_start_then_coming_up(tmp_path, caplog):
    server = RedisServer(tmp_path)  # not started yet
    chain = make_chain(4)
    caplog.set_level(logging.WARNING, logger="prefixserve.tiers")
    try:
        tier = bounded(RedisTier, server.url, scope_digest=SCOPE, connect_timeout=0.3, read_timeout=0.3)
        for _ in range(3):
            assert bounded(tier.contains, keys_of(chain)) == 0
            assert bounded(tier.get, keys_of(chain)) == [None] * 4
            bounded(tier.put, chain)
            bounded(tier.put_async, chain)
            assert bounded(tier.keys) == []
            assert (tier.used_bytes, tier.capacity_bytes) == (0, 0)
        assert tier.stats.errors >= 1 and tier.stats.dropped_puts >= 24 and tier.stats.misses == 12
        assert episode_lines(caplog) == (1, 0)
        server.start()
        wait_until_served(tier, chain)
        assert tier.get(keys_of(chain)) == [encode_record(record) for record in chain]
        assert episode_lines(caplog) == (1, 1)
        tier.flush()
        tier.close()
        tier.check_integrity()
    finally:
        server.kill()


def test_redis_killed_mid_run_then_restarted_on_the_same_port(redis_server, caplog):
    chain = make_chain(4)
    caplog.set_level(logging.WARNING, logger="prefixserve.tiers")
    now = [0.0]  # the back-off's clock, stepped by the test: no wall-clock window to outrun

    def step_past_backoff():
        now[0] += BACKOFF_SECONDS + 0.01

    with RedisTier(
        redis_server.url, scope_digest=SCOPE, connect_timeout=0.3, read_timeout=0.3, clock=lambda: now[0]
    ) as tier:
        tier.put(chain)
        assert tier.contains(keys_of(chain)) == 4
        redis_server.kill()
        for _ in range(3):  # the first fault opens the episode; each later round is one failed probe
            assert bounded(tier.contains, keys_of(chain)) == 0
            assert bounded(tier.get, keys_of(chain)) == [None] * 4
            bounded(tier.put_async, chain)
            bounded(tier.fetch(keys_of(chain)).result, BOUND_SECONDS)
            step_past_backoff()
        assert tier.stats.errors >= 3  # the first fault and the failed probes
        assert episode_lines(caplog) == (1, 0)
        redis_server.start()  # empty: no persistence
        wait_until_served(tier, chain, step_clock=step_past_backoff)
        assert tier.get(keys_of(chain)) == [encode_record(record) for record in chain]
        assert episode_lines(caplog) == (1, 1)
        tier.flush()
        tier.check_integrity()


def test_a_stalled_redis_is_a_miss_within_the_read_timeout(redis_server, caplog):
    chain = make_chain(4)
    caplog.set_level(logging.WARNING, logger="prefixserve.tiers")
    with RedisTier(redis_server.url, scope_digest=SCOPE, read_timeout=0.3) as tier:
        tier.put(chain)
        sleeper = put_to_sleep(redis_server.port, seconds=2)
        start = time.monotonic()
        assert tier.get(keys_of(chain)) == [None] * 4
        assert tier.contains(keys_of(chain)) == 0  # backing off: at once
        assert time.monotonic() - start < 1.5  # returned before Redis woke up
        assert tier.stats.errors == 1
        assert "TimeoutError" in caplog.text
        sleeper.settimeout(10)
        assert sleeper.recv(16) == b"+OK\r\n"  # awake again
        sleeper.close()
        wait_until_served(tier, chain)
        assert tier.get(keys_of(chain)) == [encode_record(record) for record in chain]


def test_a_full_redis_evicts_and_lookups_stay_consistent(tmp_path, caplog):
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru").start()
    chains = [make_chain(10, payload_bytes=64 << 10, first_token=1000 * index) for index in range(6)]  # 3.75 MiB
    caplog.set_level(logging.WARNING, logger="prefixserve.tiers")
    try:
        with RedisTier(server.url, scope_digest=SCOPE) as tier:
            assert tier.capacity_bytes == 2 << 20
            for chain in chains:
                tier.put_async(chain)
            tier.flush()
            assert (tier.stats.errors, tier.stats.dropped_puts) == (0, 0)
            all_keys = {key for chain in chains for key in keys_of(chain)}
            present = set(tier.keys())
            assert 0 < len(present) < len(all_keys) and present <= all_keys
            for chain in chains:
                run = tier.contains(keys_of(chain))
                for record, data in zip(chain, tier.get(keys_of(chain)[:run])):
                    if data is not None:  # None: evicted after `contains`, a plain miss
                        assert decode_record(data, expect(record)) == record
            assert caplog.text == ""  # allkeys-lru with a maxmemory: nothing to warn about

            server.client().config_set("maxmemory-policy", "noeviction")
            extra = make_chain(10, payload_bytes=64 << 10, first_token=99_000)
            tier.put(extra)  # Redis answers OOM: dropped, counted, logged once with the fix
            tier.put(extra)
            assert tier.stats.dropped_puts >= 1 and tier.stats.errors >= 1
            assert caplog.text.count("OutOfMemoryError") == 1 and "allkeys-lru" in caplog.text
            tier.check_integrity()
    finally:
        server.kill()


def test_settings_that_make_redis_a_poor_cache_are_named_at_start(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="prefixserve.tiers")
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "volatile-lru").start()
    try:
        RedisTier(server.url, scope_digest=SCOPE, ttl_seconds=60).close()  # volatile-lru evicts records with a TTL
        assert caplog.text == ""
        RedisTier(server.url, scope_digest=SCOPE).close()  # without a TTL nothing is evictable: writes fail when full
        assert "volatile-lru" in caplog.text and "refuses writes" in caplog.text
        server.client().config_set("maxmemory", "0")
        caplog.clear()
        RedisTier(server.url, scope_digest=SCOPE).close()
        assert "no maxmemory" in caplog.text
    finally:
        server.kill()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "checksum"),
        (lambda data: data[: len(data) // 2], "truncated"),
        (lambda data: b"not a record", "magic"),
    ],
)
def test_a_damaged_value_is_rejected_and_deleted(redis_server, damage, reason):
    chain = make_chain(2)
    name = redis_name(SCOPE, chain[1].key)
    client = redis_server.client()
    with RedisTier(redis_server.url, scope_digest=SCOPE) as tier:
        tier.put(chain)
        client.set(name, damage(client.get(name)))
        data = tier.get(keys_of(chain))
        decode_record(data[0], expect(chain[0]))
        with pytest.raises(RecordError) as error:
            decode_record(data[1], expect(chain[1]))
        assert error.value.reason == reason
        tier.reject(chain[1].key, error.value.reason)  # what the engine does
        assert client.exists(name) == 0
        assert tier.contains(keys_of(chain)) == 1
        assert tier.stats.rejected_records == 1
