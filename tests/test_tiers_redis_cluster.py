"""The remote tier on a Redis Cluster (issue 28): three masters and three replicas of Debian's redis-server on
loopback ports, started by the test. The tier finds the cluster from any node's URL, spreads a model's records
over every master, sends each key to its master (one pipeline and one back-off per master), and lives through
a master killed mid-run: its keys miss until a replica takes over, the other masters' keys keep hitting, and
no call raises. Two engines share the cluster as they share one Redis."""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("redis", reason="redis-py is not installed: pip install 'redis>=5' to test the remote tier")

from conftest import make_llm  # noqa: E402
from redis_helpers import SCOPE, expect, keys_of, make_chain, redis_cluster, redis_name  # noqa: E402,F401

from prefixserve import SamplingParams  # noqa: E402
from prefixserve.tiers import decode_record  # noqa: E402
from prefixserve.tiers.redis import RedisTier  # noqa: E402
from prefixserve.tiers.redis_nodes import SingleNode  # noqa: E402

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def stored_on(cluster, scope=SCOPE) -> dict[int, int]:
    """Records of `scope` per live master (port -> count)."""
    pattern = b"pskv:" + scope.hex().encode() + b":*"
    return {
        server.port: len(list(server.client().scan_iter(match=pattern, count=1000))) for server in cluster.masters()
    }


def test_the_tier_finds_the_cluster_and_spreads_a_models_records_over_every_master(redis_cluster):
    tier = RedisTier(redis_cluster.servers[1].url, scope_digest=SCOPE)  # any node's URL will do
    try:
        assert tier.is_cluster
        chain = make_chain(48)
        tier.put(chain)
        assert tier.contains(keys_of(chain)) == 48
        assert [decode_record(data, expect(record)) for data, record in zip(tier.get(keys_of(chain)), chain)] == chain
        per_master = stored_on(redis_cluster)
        assert len(per_master) == 3 and all(count > 0 for count in per_master.values()), per_master
        assert sum(per_master.values()) == 48
        assert sorted(tier.keys()) == sorted(keys_of(chain))  # SCAN on every master
        assert tier.used_bytes > 0
        tier.delete(keys_of(chain)[:10])
        assert tier.contains(keys_of(chain)) == 0 and sum(stored_on(redis_cluster).values()) == 38
    finally:
        tier.close()


def test_a_killed_master_costs_only_its_own_keys_until_its_replica_takes_over(redis_cluster, caplog):
    tier = RedisTier(redis_cluster.url, scope_digest=SCOPE, connect_timeout=0.3, read_timeout=0.5)
    try:
        chain = make_chain(48)
        tier.put(chain)
        victim = redis_cluster.owner_of(redis_name(SCOPE, chain[0].key))
        lost = {record.key for record in chain if redis_cluster.owner_of(redis_name(SCOPE, record.key)) is victim}
        assert 0 < len(lost) < len(chain)
        victim.kill()
        with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
            found = tier.get(keys_of(chain))  # never raises; the victim's keys miss, the others' hit
        assert {record.key for record, data in zip(chain, found) if data is None} == lost
        assert tier.stats.errors >= 1 and "failed during get" in caplog.text
        redis_cluster.wait(
            lambda: (
                len(redis_cluster.masters()) == 3
                and all(redis_cluster.info(server)["cluster_state"] == "ok" for server in redis_cluster.masters())
            )
        )
        # the replica holds what its master had (replicated before the kill): hits resume once the tier's
        # back-off passes and its slot map is refreshed
        redis_cluster.wait(lambda: all(data is not None for data in tier.get(keys_of(chain))), seconds=15)
        more = make_chain(16, first_token=10_000)
        tier.put(more)
        assert tier.contains(keys_of(more)) == 16
    finally:
        tier.close()


def test_a_client_that_took_the_cluster_for_one_server_switches_at_the_first_moved(redis_cluster, monkeypatch):
    import prefixserve.tiers.redis as redis_tier_module

    monkeypatch.setattr(
        redis_tier_module,
        "connect_nodes",
        lambda client, url, ct, rt, backoff, where, clock: SingleNode(client, where, backoff),
    )
    tier = RedisTier(redis_cluster.url, scope_digest=SCOPE)
    try:
        assert not tier.is_cluster
        chain = make_chain(24)
        tier.put(chain)  # most keys belong to other masters: MOVED, counted, dropped; the tier switches
        assert tier.is_cluster and tier.stats.errors > 0
        tier.put(chain)
        assert tier.contains(keys_of(chain)) == 24
    finally:
        tier.close()


def test_two_engines_share_the_cluster_and_live_through_a_failover(redis_cluster, tier_secret_file):
    rng = random.Random(3)
    batch = [[rng.randrange(10, 8000) for _ in range(256)] + [5, 6, 7] for _ in range(3)]
    options = {"kv_remote_url": redis_cluster.url, "kv_tier_secret_file": tier_secret_file, "kv_remote_timeout": 0.5}
    writer = make_llm(**options)
    expected = [writer.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids for prompt in batch]
    writer.engine.tiers.tiers["remote"].flush()
    assert all(count > 0 for count in stored_on(redis_cluster, writer.engine.scope.digest).values())
    reader = make_llm(kv_fetch_policy="always", **options)
    first = reader.generate([batch[0]], GREEDY, use_tqdm=False)[0]
    assert first.token_ids == expected[0] and first.cached_tokens_by_tier["remote"] == 256
    scope = writer.engine.scope.digest
    stored = sum(stored_on(redis_cluster, scope).values())
    redis_cluster.masters()[0].kill()
    during = [reader.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in batch[1:]]
    assert [out.token_ids for out in during] == expected[1:]  # recomputed where a master was gone: no error
    assert all(out.finish_reason == "length" for out in during)
    redis_cluster.wait(
        lambda: (
            len(redis_cluster.masters()) == 3
            and all(redis_cluster.info(server)["cluster_state"] == "ok" for server in redis_cluster.masters())
        )
    )
    redis_cluster.wait(lambda: sum(stored_on(redis_cluster, scope).values()) >= stored)  # the replica had it all
    late = make_llm(kv_fetch_policy="always", **{**options, "kv_remote_url": redis_cluster.masters()[0].url})
    out = late.generate([batch[2]], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected[2] and out.cached_tokens_by_tier["remote"] == 256
