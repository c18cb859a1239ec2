"""Random interleavings of admissions, TTLs, operator pins, the hot-prefix policy, expiry and reloads.

After every step: the cache's own invariants, the policy's accounting, and what pins promise
(a pinned block is never evicted or expired, until unpinned, cooled or reloaded away).
"""

from cache_helpers import FakeRequest, admit, finish, insert_full_blocks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache
from prefixserve.cache.hot_prefixes import HotPrefixPolicy

BS = 4
SCOPES = [CacheScope("m1", "t1"), CacheScope("m1", "t1", cache_salt="tenant")]
STEMS = [[1] * 8, [1] * 4 + [2] * 5, [3] * 6]  # short: their paths fit the policy's budget
MAX_PINNED = 12

request = st.tuples(
    st.just("request"),
    st.integers(0, len(STEMS) - 1),
    st.integers(0, 2),
    st.integers(0, 1),
    st.sampled_from([None, 1.0, 5.0]),
    st.integers(1, 3),
)  # the last: how many times it is sent
# Nested one_of weights the branches: requests (reuse is what turns a prefix hot) a third of the time,
# the operations that wipe state (evict, reload) rarely.
operation = st.one_of(
    request,
    st.one_of(st.tuples(st.just("tick"), st.floats(0.0, 3.0)), st.tuples(st.just("policy"))),
    st.one_of(
        st.tuples(st.just("pin"), st.integers(0, len(STEMS) - 1), st.integers(0, 1)),
        st.tuples(st.just("unpin"), st.integers(0, 99)),
    ),
    st.one_of(
        st.tuples(st.just("expire")),
        st.tuples(st.just("evict"), st.integers(1, 8)),
        st.tuples(st.just("reload")),
        st.tuples(st.just("give_way")),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=20, max_size=80), st.integers(8, 24))
def test_pins_ttls_and_the_hot_policy_keep_their_promises(operations, num_blocks):
    now = [0.0]
    cache = RadixCache(num_blocks, BS, max_pinned_blocks=MAX_PINNED, clock=lambda: now[0])
    policy = HotPrefixPolicy(min_requests=2, window_seconds=3.0, max_blocks=4, clock=lambda: now[0])
    keyer = BlockKeyer(BS)
    operator_pins: list[list[bytes]] = []  # paths, each pinned once by the "operator"
    for op in operations:
        kind = op[0]
        if kind == "request":  # admit, compute, finish: the engine's life cycle in one go
            _, stem, extra, scope, ttl, repeats = op
            tokens = STEMS[stem] + [100 + extra] * (extra % 5 + 1)
            for _ in range(repeats):
                request = FakeRequest(tokens, SCOPES[scope].digest)
                keyer.extend(request.keys, request.scope_digest, tokens)
                hit = cache.match(request.scope_digest, request.keys, tokens, record_stats=False)
                needed = -(-len(tokens) // BS) - len(hit.blocks)
                if cache.can_allocate(needed):
                    admit(cache, keyer, request, 0, ttl)
                    policy.observe(request.keys[: request.num_cached_tokens // BS])
                    insert_full_blocks(cache, request, ttl)
                    finish(cache, request)
        elif kind == "pin":
            keys = keyer.keys(SCOPES[op[2]].digest, STEMS[op[1]])
            try:
                num_pinned = cache.pin(keys)
            except ValueError:
                num_pinned = 0
            if num_pinned:
                operator_pins.append(keys[:num_pinned])
        elif kind == "unpin" and operator_pins:
            cache.unpin(operator_pins.pop(op[1] % len(operator_pins)))
        elif kind == "tick":
            now[0] += op[1]
        elif kind == "policy":
            policy.tick(cache, force=True)
            horizon = now[0] - policy.window_seconds  # after a tick, only what is still hot stays pinned
            assert all(
                sum(hit >= horizon for hit in tracked.hits) >= policy.min_requests
                for tracked in policy._tracked.values()
                if tracked.pinned_path
            )
        elif kind == "expire":
            cache.expire()
        elif kind == "evict":
            cache.evict(op[1])
        elif kind == "reload":  # what swap_model does: every block freed, every pin with it
            cache.clear()
            policy.reset()
            operator_pins.clear()
        elif kind == "give_way":  # a request needed the room: policy pins are soft
            policy.unpin_all(cache)
        cache.check_integrity()
        policy_paths = policy.pinned_paths
        assert policy.num_pinned_blocks == sum(len(path) for path in policy_paths) <= policy.max_blocks
        for path in [*policy_paths, *operator_pins]:  # a pinned block never leaves: not evicted, not expired
            for key in path:
                block = cache._index.get(key)
                assert block is not None and block.pin_count > 0, "a pinned block was reclaimed"
        assert cache.usage().num_pinned_blocks <= MAX_PINNED
    policy.unpin_all(cache)
    for path in operator_pins:
        cache.unpin(path)
    cache.check_integrity()
    assert cache.usage().num_pinned_blocks == 0  # every pin was undone exactly once
