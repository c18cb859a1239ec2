"""Tenants' shares of one cache (cache/tenant_shares.py): a minimum another tenant's traffic cannot evict, a
maximum past which a tenant's own blocks make room (or a block is served uncached), in the device pool and in
the host and disk tiers; pins within a tenant's pin_share, and the operator's pins first."""

import random

import pytest
from cache_helpers import FakeRequest, admit, finish, insert_full_blocks

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache
from prefixserve.cache.hot_prefixes import HotPrefixPolicy
from prefixserve.cache.tenant_pins import PinShareError, TenantPins
from prefixserve.cache.tenant_shares import Share, TenantShares
from prefixserve.config import EngineConfig
from prefixserve.tiers.lru import LeafFirstLRU

SCOPE = CacheScope("model", "tokenizer")
BS = 4


def scope_of(tenant):
    return SCOPE.with_salt(f"tenant={tenant}").digest


def run(cache, keyer, tokens, tenant):
    request = admit(cache, keyer, FakeRequest(list(tokens), scope_of(tenant), owner=tenant))
    insert_full_blocks(cache, request)
    finish(cache, request)
    cache.check_integrity()
    return request


def one_off(rng, num_tokens=4 * BS + 1):
    return [rng.randrange(1000, 50_000) for _ in range(num_tokens)]


def warm_then_flood(shares, num_flood=40):
    """A's prefix (4 blocks) cached, then B's flood of one-off prompts; how much of A's prefix still hits."""
    cache, keyer = RadixCache(32, BS, shares=shares), BlockKeyer(BS)
    a_prompt = list(range(1, 4 * BS + 2))
    run(cache, keyer, a_prompt, "a")
    rng = random.Random(7)
    for _ in range(num_flood):
        run(cache, keyer, one_off(rng), "b")
    probe = FakeRequest(a_prompt, scope_of("a"), owner="a")
    keyer.extend(probe.keys, probe.scope_digest, probe.token_ids)
    return cache, cache.match(probe.scope_digest, probe.keys, probe.token_ids).num_tokens


def test_a_minimum_keeps_a_tenants_prefix_through_another_tenants_flood():
    _, without = warm_then_flood(TenantShares())
    cache, with_minimum = warm_then_flood(TenantShares({"a": Share(min_kv_share=0.125)}))
    assert without == 0  # plain LRU: B's flood evicted all of A
    assert with_minimum == 4 * BS  # 0.125 of 32 blocks = 4: A keeps all of its prefix
    assert cache.tenants.holdings.held["a"] == 4
    assert cache.stats.num_min_share_overrides == 0


def test_a_tenant_evicts_its_own_blocks_below_its_minimum():
    cache, keyer = RadixCache(16, BS, shares=TenantShares({"a": Share(min_kv_share=0.5)})), BlockKeyer(BS)
    rng = random.Random(3)
    for _ in range(12):  # A alone, far past its minimum and the pool: its own traffic moves its blocks
        run(cache, keyer, one_off(rng), "a")
    assert cache.tenants.holdings.held["a"] <= 16


def test_a_maximum_bounds_a_tenant_and_its_own_coldest_blocks_make_room():
    shares = TenantShares({"b": Share(max_kv_share=0.25)})
    cache, keyer = RadixCache(32, BS, shares=shares), BlockKeyer(BS)
    a = run(cache, keyer, list(range(1, 4 * BS + 2)), "a")
    rng = random.Random(5)
    last = None
    for _ in range(10):
        last = run(cache, keyer, one_off(rng), "b")
        assert cache.tenants.holdings.held["b"] <= 8  # 0.25 of 32
    assert cache.tenants.holdings.held["a"] == 4  # never touched: B made room among its own blocks
    probe = FakeRequest(last.token_ids, scope_of("b"), owner="b")
    keyer.extend(probe.keys, probe.scope_digest, probe.token_ids)
    assert cache.match(probe.scope_digest, probe.keys, probe.token_ids).num_tokens == 4 * BS  # its newest kept
    assert a.token_ids


def test_past_its_maximum_with_nothing_of_its_own_to_evict_a_block_is_served_uncached():
    cache, keyer = RadixCache(32, BS, shares=TenantShares({"b": Share(max_kv_share=0.125)})), BlockKeyer(BS)
    request = admit(cache, keyer, FakeRequest(list(range(1, 8 * BS + 2)), scope_of("b"), owner="b"))
    insert_full_blocks(cache, request)  # 8 full blocks, all held by the request: 4 cached, 4 stay private
    cache.check_integrity()
    assert cache.tenants.holdings.held["b"] == 4
    assert sum(block.key is not None for block in request.blocks) == 4
    assert cache.stats.by_tenant["b"].over_share_refusals == 1  # one refusal: what follows has no cached parent
    finish(cache, request)
    cache.check_integrity()
    assert cache.pool.num_free_blocks == 32 - 4  # the uncached blocks went back to the free list


def test_a_lone_request_may_go_below_a_minimum_rather_than_never_run():
    cache, keyer = RadixCache(16, BS, shares=TenantShares({"a": Share(min_kv_share=0.75)})), BlockKeyer(BS)
    rng = random.Random(11)
    for _ in range(3):
        run(cache, keyer, one_off(rng), "a")  # A: 12 blocks, all within its minimum
    big = FakeRequest(one_off(rng, 10 * BS), scope_of("b"), owner="b")
    keyer.extend(big.keys, big.scope_digest, big.token_ids)
    assert not cache.can_allocate(10, "b")
    assert cache.can_allocate(10, "b", guard_minimums=False)
    blocks = cache.admit([], 10, requester="b", guard_minimums=False)
    assert blocks is not None and len(blocks) == 10
    assert cache.stats.num_min_share_overrides == 6  # 4 free, then 6 of A's: each breach counted
    cache.release(blocks)
    cache.check_integrity()


def test_shares_are_checked_and_named():
    with pytest.raises(ValueError, match="min_kv_share"):
        TenantShares({"a": Share(min_kv_share=0.6), "b": Share(min_kv_share=0.4)})
    with pytest.raises(ValueError, match="must not exceed max_kv_share"):
        TenantShares({"a": Share(min_kv_share=0.5, max_kv_share=0.25)})
    with pytest.raises(ValueError, match="pin_share must be a fraction"):
        EngineConfig(tenant_shares={"a": {"pin_share": 2}})
    with pytest.raises(ValueError, match="some of"):
        EngineConfig(tenant_shares={"a": {"pin_quota": 0.5}})
    config = EngineConfig(tenant_shares='{"a": {"min_kv_share": 0.2}}', tenant_pin_share=0.5)
    assert config.shares().of("a") == Share(pin_share=0.5, min_kv_share=0.2)  # the defaults fill the rest
    assert config.shares().of("z") == Share(pin_share=0.5)
    assert config.shares().of(None) is None  # nobody's blocks have no share


def test_a_tier_keeps_a_tenants_minimum_and_bounds_its_maximum():
    shares = TenantShares({"a": Share(min_kv_share=0.25), "b": Share(max_kv_share=0.5)})
    from prefixserve.cache.tenant_shares import TenantHoldings

    lru = LeafFirstLRU(TenantHoldings(shares, 1000))
    for index in range(3):
        assert lru.insert_and_evict(b"a%d" % index, None, 100, 1000, "a").admitted
    evicted = []
    for index in range(30):
        admission = lru.insert_and_evict(b"b%d" % index, None, 100, 1000, "b")
        evicted += [entry.key for entry in admission.evicted]
        lru.check_integrity()
        assert lru.holdings.held["b"] <= 500
    assert lru.holdings.held["a"] == 300 and not any(key.startswith(b"a") for key in evicted)  # B's own went
    nobody = [lru.insert_and_evict(b"n%d" % index, None, 100, 1000) for index in range(10)]
    lru.check_integrity()
    assert all(admission.admitted for admission in nobody)
    assert lru.holdings.held["a"] == 300  # 300 - 100 would pass below A's minimum of 250 bytes: B's went instead
    assert lru.insert_and_evict(b"a3", None, 100, 1000, "a").admitted  # A's own traffic evicts as usual


def test_tenant_pins_stop_at_the_share_and_hot_pins_count_against_it():
    pins = TenantPins(TenantShares(default=Share(pin_share=0.25)), max_pinned_blocks=40)
    pins.claim("b", 6)
    with pytest.raises(PinShareError, match="pin_share of 10 blocks"):
        pins.claim("b", 6)
    pins.claim("a", 10)
    pins.claim(None, 1000)  # nobody's pins (the operator's) claim nothing
    assert pins.report() == {"a": {"pinned": 10, "limit": 10}, "b": {"pinned": 6, "limit": 10}}
    pins.release("b", 6)
    assert "b" not in pins.held

    cache, keyer = RadixCache(64, BS, max_pinned_blocks=40), BlockKeyer(BS)
    hot = HotPrefixPolicy(2, 60.0, max_blocks=40, clock=lambda: 0.0, tenant_pins=pins)
    prompts = [list(range(start, start + 5 * BS + 1)) for start in (1, 200)]
    for prompt in prompts:
        for _ in range(2):
            request = run(cache, keyer, prompt, "b")
            hot.observe(request.keys[:5])
    hot.tick(cache, force=True)
    assert pins.held["b"] == 10  # the first hot prefix (5 blocks) fits B's 10, and the second too ...
    hot.unpin_all(cache)
    assert "b" not in pins.held
    pins.claim("b", 6)
    hot.tick(cache, force=True)
    assert pins.held["b"] == 6  # ... but not once B's other pins hold 6: 6 + 5 > 10


def test_the_host_tier_keeps_a_tenants_minimum_against_anothers_records():
    from prefixserve.tiers.host import HostTier
    from prefixserve.tiers.record import BlockRecord

    def record(name: bytes, owner):
        return BlockRecord(name.ljust(32, b"."), None, SCOPE.digest, (1, 2), "float32", (1, 4), bytes(16), owner=owner)

    size = len(HostTier(1 << 20).encode(record(b"probe", None)))
    shares = TenantShares({"a": Share(min_kv_share=0.3), "b": Share(max_kv_share=0.5)})
    with HostTier(10 * size, shares=shares) as tier:
        tier.put([record(b"a%d" % index, "a") for index in range(3)])
        tier.put([record(b"b%d" % index, "b") for index in range(20)])
        tier.check_integrity()
        assert tier.tenant_holdings()["b"]["held"] == 5 * size  # B never above half: its own records made room
        tier.put([record(b"n%d" % index, None) for index in range(20)])
        tier.check_integrity()
        held = tier.tenant_holdings()
        assert held["a"]["held"] == 3 * size  # its minimum of 3 records (0.3 of 10) kept through both floods
        assert "b" not in held  # B has no minimum: nobody's records evicted it
        assert tier.contains([record(b"a0", "a").key]) == 1


def test_leaf_heaps_pop_the_coldest_live_leaf_an_owner_filter_allows():
    """Against a brute-force model: random pushes (re-pushes make old entries stale), removals, pops for an
    owner, and pops that may not take some owners' leaves."""
    from prefixserve.cache.leaf_heaps import LeafHeaps

    rng = random.Random(1)
    live: dict[int, tuple[int, object]] = {}  # ident -> (last access, owner)
    heaps = LeafHeaps(lambda owner, last, ident: live.get(ident) == (last, owner))
    owners = [None, "a", "b", "c"]
    tick = 0
    for _ in range(4000):
        action = rng.random()
        if action < 0.5:
            tick += 1
            ident, owner = rng.randrange(200), rng.choice(owners)
            live[ident] = (tick, owner)
            heaps.push(owner, tick, ident, len(live))
        elif action < 0.6 and live:
            del live[rng.choice(list(live))]  # no longer a leaf: its entries go stale
        elif action < 0.75:
            owner = rng.choice(owners)
            mine = [(last, ident) for ident, (last, o) in live.items() if o == owner]
            got = heaps.pop_of(owner)
            assert got == (min(mine)[1] if mine else None)
            if got is not None:
                del live[got]
        else:
            barred = set(rng.sample(owners, rng.randrange(len(owners))))
            allowed = [(last, ident) for ident, (last, o) in live.items() if o not in barred]
            got = heaps.pop(lambda owner, ident, barred=barred: owner not in barred)
            assert got == (min(allowed)[1] if allowed else None)
            if got is not None:
                del live[got]
    assert heaps.live() == {(last, ident) for ident, (last, _) in live.items()}
