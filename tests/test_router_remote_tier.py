"""The HTTP router prices the fleet-shared remote tier: it asks Redis for a request's leading run, and
kv_aware sends a request to an idle replica that can fetch its prefix rather than queue behind the
busy one holding it in its pool."""

import asyncio

from prefixserve.cache import BlockKeyer, CacheScope
from prefixserve.router.costs import CostModel, policy_options_for
from prefixserve.router.policies import RouteRequest
from prefixserve.router.policy_registry import make_policy
from prefixserve.router.replicas import Replica
from prefixserve.tiers import BlockRecord
from prefixserve.tiers.redis import RedisTier

SCOPE = CacheScope("model", "tokenizer")


def route_for(tokens, remote_blocks=0):
    keys = BlockKeyer(16).keys(SCOPE.digest, tokens)
    return RouteRequest(keys, tokens, SCOPE.digest, -(-len(tokens) // 16), 16, remote_blocks)


def test_an_idle_replica_that_can_fetch_wins_over_a_busy_holder():
    tokens = list(range(100, 100 + 2000)) + [7]
    holder, idle = Replica("http://a", "a"), Replica("http://b", "b")
    for replica in (holder, idle):
        replica.healthy = True
    holder.mirror.keys.update(route_for(tokens).keys)
    holder.outstanding[1] = 0.3  # seconds of queued work: less than recomputing, more than fetching
    policy = make_policy("kv_aware", policy_options_for(CostModel()))
    assert [holder, idle][policy.choose(route_for(tokens), [holder, idle])] is holder  # nothing below: wait
    fetchable = route_for(tokens, remote_blocks=len(route_for(tokens).keys))
    assert idle.lower_tier_run(fetchable) == [("remote", 125)] and holder.lower_tier_run(fetchable) == []
    assert [holder, idle][policy.choose(fetchable, [holder, idle])] is idle  # fetching beats a 0.3 s queue


def test_the_router_learns_the_remote_run_from_redis(shared_redis):
    from prefixserve.router.app import RouterSettings
    from prefixserve.router.fleet import Router

    tokens = list(range(500, 500 + 64)) + [3]
    keys = BlockKeyer(16).keys(SCOPE.digest, tokens)
    writer = RedisTier(shared_redis.url, scope_digest=SCOPE.digest)
    parents = [None, *keys[:-1]]
    writer.put(
        [
            BlockRecord(key, parent, SCOPE.digest, tuple(tokens[i * 16 : (i + 1) * 16]), "float32", (16,), bytes(64))
            for i, (key, parent) in enumerate(zip(keys[:3], parents))
        ]
    )
    router = Router(RouterSettings(replicas=("http://127.0.0.1:9",), kv_remote_url=shared_redis.url))
    router._open_remote(SCOPE.digest)
    route = asyncio.run(router.with_remote_run(route_for(tokens)))
    assert route.remote_blocks == 3  # of the 4 full blocks, the first 3 are in Redis
    router.remote.close()
    writer.close()


def test_the_router_mirrors_a_replicas_own_tiers_from_kv_events():
    from prefixserve.cache import BlockRemoved, BlockStored

    tokens = list(range(100, 100 + 160)) + [7]  # 10 full blocks
    keys = route_for(tokens).keys
    replica = Replica("http://a", "a")
    replica.healthy = True
    for event in (
        BlockStored(keys[:2], None, [], 16),  # device pool ("GPU")
        BlockStored(keys[2:5], None, [], 16, "CPU"),
        BlockStored(keys[2:8], None, [], 16, "DISK"),
        BlockRemoved(keys[4:5], "CPU"),
    ):
        replica.mirror.apply(event)
    request = route_for(tokens, remote_blocks=9)
    assert replica.num_hit_blocks(request) == 2
    assert replica.lower_tier_run(request) == [("host", 2), ("disk", 4), ("remote", 1)]
    replica.mark_down("test")
    assert replica.mirror.tier_keys == {} and replica.lower_tier_run(route_for(tokens)) == []
