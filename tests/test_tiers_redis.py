"""The remote tier against a real redis-server: round trips, one-round-trip lookups, namespacing, TTL,
the write cap, the write queue, URLs (password, database, TLS) and threads."""

from __future__ import annotations

import logging

import pytest
from redis_helpers import (
    OTHER_SCOPE,
    SCOPE,
    RedisServer,
    expect,
    keys_of,
    make_chain,
    redis_name,
    redis_server,  # noqa: F401  (a fixture)
)
from tier_helpers import run_in_threads

from prefixserve.tiers import BlockRecord, decode_record, encode_record

pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")
from prefixserve.tiers.redis import RedisTier  # noqa: E402
from prefixserve.tiers.redis_client import redacted  # noqa: E402


def count_sends(monkeypatch) -> list[int]:
    """Counts requests written to Redis: a pipeline writes all its commands at once, so one per round trip."""
    from redis.connection import AbstractConnection

    sends = [0]
    original = AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sends[0] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return sends


def test_records_round_trip_and_are_verified_like_a_disk_read(redis_server):
    chain = make_chain(4)
    with RedisTier(redis_server.url, scope_digest=SCOPE) as tier:
        assert tier.name == "remote"
        assert tier.get(keys_of(chain)) == [None] * 4
        tier.put(chain)
        encoded = [encode_record(record) for record in chain]
        assert tier.get(keys_of(chain)) == encoded
        assert [decode_record(data, expect(record)) for data, record in zip(encoded, chain)] == chain
        assert tier.fetch(keys_of(chain)[:2]).result(timeout=5) == encoded[:2]
        tier.put(chain)  # already there: nothing is sent again
        stats = tier.stats
        assert (stats.hits, stats.misses, stats.errors, stats.dropped_puts) == (6, 4, 0, 0)
        assert stats.bytes_written == sum(map(len, encoded))
        assert stats.bytes_read == sum(map(len, encoded)) + sum(map(len, encoded[:2]))
        assert tier.read_cost.num_observations == 2
        tier.delete(keys_of(chain)[2:])
        assert tier.contains(keys_of(chain)) == 2
        tier.check_integrity()


def test_contains_is_one_round_trip_and_returns_the_leading_run(redis_server, monkeypatch):
    chain = make_chain(6)
    keys = keys_of(chain)
    with RedisTier(redis_server.url, scope_digest=SCOPE) as tier:
        tier.put(chain)
        tier.delete([keys[3]])
        assert tier.contains(keys) == 3  # also opens the connection, so the count below is the lookup alone
        client = redis_server.client()
        client.config_resetstat()
        sends = count_sends(monkeypatch)
        assert tier.contains(keys) == 3
        assert sends[0] == 1
        monkeypatch.undo()
        assert client.info("commandstats")["cmdstat_exists"]["calls"] == 6  # one EXISTS per key, all of them
        assert tier.contains(keys[4:]) == 2
        assert tier.contains(keys[3:]) == 0
        assert tier.contains([]) == 0


def test_scopes_cannot_see_each_others_records(redis_server):
    chain, other_chain = make_chain(3), make_chain(3, scope=OTHER_SCOPE)
    with (
        RedisTier(redis_server.url, scope_digest=SCOPE) as tier,
        RedisTier(redis_server.url, scope_digest=OTHER_SCOPE) as other,
    ):
        tier.put(chain)
        assert other.contains(keys_of(chain)) == 0
        assert other.get(keys_of(chain)) == [None] * 3
        assert other.keys() == []
        other.delete(keys_of(chain))  # names its own namespace: ours stays
        other.put(other_chain)
        assert tier.contains(keys_of(chain)) == 3
        assert sorted(tier.keys()) == sorted(keys_of(chain))
        assert sorted(other.keys()) == sorted(keys_of(other_chain))
        names = set(redis_server.client().keys("*"))
        assert names == {redis_name(SCOPE, key) for key in keys_of(chain)} | {
            redis_name(OTHER_SCOPE, key) for key in keys_of(other_chain)
        }


def test_records_expire_after_the_ttl_and_a_read_or_rewrite_renews_it(redis_server):
    chain = make_chain(2)
    client = redis_server.client()
    first, second = (redis_name(SCOPE, key) for key in keys_of(chain))
    with RedisTier(redis_server.url, scope_digest=SCOPE, ttl_seconds=100) as tier:
        tier.put(chain)
        assert 90_000 < client.pttl(first) <= 100_000
        client.pexpire(first, 5_000)
        client.pexpire(second, 5_000)
        assert tier.get(keys_of(chain)[:1])[0] is not None
        assert client.pttl(first) > 90_000
        tier.put(chain)  # present: not sent again, but its TTL is renewed
        assert client.pttl(second) > 90_000
        assert tier.stats.bytes_written == sum(len(encode_record(record)) for record in chain)
    client.flushall()
    with RedisTier(redis_server.url, scope_digest=SCOPE) as tier:
        tier.put(chain)
        assert client.ttl(first) == -1  # no TTL: Redis's maxmemory policy decides


def test_the_write_cap_drops_what_exceeds_it_and_every_block_after_a_dropped_parent(redis_server, caplog):
    chain = make_chain(10, payload_bytes=4000)
    record_bytes = len(encode_record(chain[1]))  # block 0 has no parent key: it is 32 bytes shorter
    caplog.set_level(logging.INFO, logger="prefixserve.tiers")
    with RedisTier(redis_server.url, scope_digest=SCOPE, max_write_bytes_per_second=3 * record_bytes) as tier:
        tier.put(chain)  # the bucket starts with one second's worth: three records
        assert tier.contains(keys_of(chain)) == 3
        assert len(tier.keys()) == 3
        stats = tier.stats
        assert (stats.dropped_puts, stats.errors, stats.bytes_written) == (
            7,
            0,
            sum(len(encode_record(record)) for record in chain[:3]),
        )
        tier.put(chain[3:])
        assert tier.stats.dropped_puts == 14  # the bucket refills at 3 records a second: not yet one record
    assert caplog.text.count("write cap") == 1


def test_put_async_never_blocks_and_drops_what_the_queue_cannot_hold(redis_server):
    chain = make_chain(10, payload_bytes=1000)
    with RedisTier(redis_server.url, scope_digest=SCOPE, max_pending_bytes=3 * 1000) as tier:
        tier.put_async(chain)
        assert tier.stats.dropped_puts == 7
        tier.flush()
        tier.check_integrity()
        assert tier.contains(keys_of(chain)) == 3
    tier.put_async(chain)  # closed
    assert tier.stats.dropped_puts == 17


def test_a_password_and_database_in_the_url(tmp_path, caplog):
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        chain = make_chain(2)
        url = f"redis://:s3cret@127.0.0.1:{server.port}/2"
        with RedisTier(url, scope_digest=SCOPE) as tier:
            tier.put(chain)
            assert tier.contains(keys_of(chain)) == 2
            assert tier.url == f"redis://:***@127.0.0.1:{server.port}/2"
        assert server.client(db=2).dbsize() == 2
        assert server.client(db=0).dbsize() == 0
        with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
            with RedisTier(f"redis://:wrong@127.0.0.1:{server.port}/2", scope_digest=SCOPE) as tier:
                assert tier.contains(keys_of(chain)) == 0
                assert tier.get(keys_of(chain)) == [None, None]
                assert tier.stats.errors >= 1
        assert "AuthenticationError" in caplog.text and ":wrong@" not in caplog.text
    finally:
        server.kill()


def test_tls_with_rediss(tmp_path):
    server = RedisServer(tmp_path, password="pw", tls=True).start()
    try:
        chain = make_chain(3)
        with RedisTier(server.url, scope_digest=SCOPE) as tier:
            assert server.url.startswith("rediss://:pw@")
            tier.put(chain)
            assert tier.get(keys_of(chain)) == [encode_record(record) for record in chain]
            assert tier.stats.errors == 0
    finally:
        server.kill()


def test_a_malformed_url_names_the_fix():
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://127.0.0.1:6379/0", scope_digest=SCOPE)


def test_urls_in_messages_hide_the_password():
    assert redacted("redis://:pw@host:1/0") == "redis://:***@host:1/0"
    assert redacted("rediss://user:pw@host:1/0?x=1") == "rediss://user:***@host:1/0?x=1"
    assert redacted("redis://host:1/0") == "redis://host:1/0"


def test_memory_comes_from_redis_and_is_asked_at_most_once_a_second(tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        with RedisTier(server.url, scope_digest=SCOPE) as tier:
            client = server.client()
            client.config_resetstat()
            assert tier.capacity_bytes == 3 << 20
            assert 0 < tier.used_bytes < 3 << 20
            for _ in range(10):
                assert tier.used_bytes > 0
            assert client.info("commandstats").get("cmdstat_info", {}).get("calls", 0) <= 1
    finally:
        server.kill()


def test_threads_share_one_tier(redis_server):
    chains = [make_chain(5, first_token=1000 * index) for index in range(8)]
    with RedisTier(redis_server.url, scope_digest=SCOPE) as tier:

        def work(chain: list[BlockRecord]) -> None:
            for _ in range(5):
                tier.put_async(chain)
                tier.contains(keys_of(chain))
                tier.fetch(keys_of(chain)).result(timeout=10)

        errors = run_in_threads(work, chains, timeout=30)
        tier.flush()
        assert errors == []
        tier.check_integrity()
        assert all(tier.contains(keys_of(chain)) == 5 for chain in chains)
        assert (tier.stats.errors, tier.stats.dropped_puts) == (0, 0)


def test_backoff_lets_one_probe_through_after_each_back_off():
    from prefixserve.tiers.redis_backoff import Backoff

    now = [0.0]
    backoff = Backoff(1.0, clock=lambda: now[0])
    assert backoff.try_begin() and backoff.succeeded() is None
    assert backoff.failed() is True and backoff.failed() is False  # one episode, two faults
    assert backoff.is_backing_off and not backoff.try_begin()
    now[0] = 1.5
    assert not backoff.is_backing_off
    assert backoff.try_begin() and not backoff.try_begin()  # the probe, and only one
    assert backoff.is_backing_off
    assert backoff.failed() is False  # the probe failed: back off again from now
    now[0] = 2.0
    assert not backoff.try_begin()
    now[0] = 2.5
    assert backoff.try_begin()
    assert backoff.succeeded() == (2.5, 3)
    assert backoff.try_begin() and backoff.try_begin() and backoff.num_episodes == 1


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    from prefixserve.tiers.redis_rate import TokenBucket

    now = [0.0]
    bucket = TokenBucket(1000, clock=lambda: now[0])
    assert bucket.try_take(600) and not bucket.try_take(600) and bucket.try_take(400)
    now[0] = 0.5
    assert not bucket.try_take(600) and bucket.try_take(500)
    now[0] = 10.0
    assert not bucket.try_take(1001) and bucket.try_take(1000)
