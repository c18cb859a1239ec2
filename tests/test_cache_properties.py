"""Random interleavings of every cache operation, with check_integrity() after each step."""

import random

from cache_helpers import FakeRequest, admit, finish, insert_full_blocks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.cache import BlockKeyer, CacheScope, OutOfBlocksError, RadixCache

BS = 4
SCOPES = [CacheScope("m1", "t1"), CacheScope("m1", "t1", cache_salt="tenant"), CacheScope("m2", "t1")]
# Few distinct prompt stems so requests share prefixes often.
STEMS = [[1] * 12, [1] * 8 + [2] * 4, [3] * 6, [1] * 4 + [5] * 9]

operation = st.one_of(
    st.tuples(
        st.just("admit"),
        st.integers(0, len(STEMS) - 1),
        st.integers(0, 9),
        st.integers(0, 2),
        st.integers(0, 6),
        st.sampled_from([None, 1.0, 5.0]),
    ),
    st.tuples(st.just("insert"), st.integers(0, 99)),
    st.tuples(st.just("finish"), st.integers(0, 99)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("pin"), st.integers(0, len(STEMS) - 1), st.integers(0, 2)),
    st.tuples(st.just("unpin"), st.integers(0, 99)),
    st.tuples(st.just("clear"), st.integers(-1, 2)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=60), st.integers(6, 24))
def test_random_operations_keep_every_invariant(operations, num_blocks):
    now = [0.0]
    cache = RadixCache(num_blocks, BS, max_pinned_blocks=4, clock=lambda: now[0])
    keyer = BlockKeyer(BS)
    running: list[FakeRequest] = []
    pins: list[list[bytes]] = []
    for op in operations:
        kind = op[0]
        if kind == "admit":
            _, stem, extra, scope, output, ttl = op
            tokens = STEMS[stem] + [100 + extra] * (extra % 5 + 1)
            request = FakeRequest(tokens, SCOPES[scope].digest)
            keyer.extend(request.keys, request.scope_digest, tokens)
            hit = cache.match(request.scope_digest, request.keys, tokens, record_stats=False)
            needed = -(-(len(tokens) + output) // BS) - len(hit.blocks)
            if cache.can_allocate(needed):
                running.append(admit(cache, keyer, request, output, ttl))
            else:
                try:
                    cache.allocate(needed)
                    raise AssertionError("allocate succeeded although can_allocate said no")
                except OutOfBlocksError:
                    pass
        elif kind == "insert" and running:
            insert_full_blocks(cache, running[op[1] % len(running)])
        elif kind == "finish" and running:
            finish(cache, running.pop(op[1] % len(running)))
        elif kind == "evict":
            cache.evict(op[1])
        elif kind == "tick":
            now[0] += op[1]
        elif kind == "expire":
            cache.expire()
        elif kind == "pin":
            keys = keyer.keys(SCOPES[op[2]].digest, STEMS[op[1]])
            try:
                if cache.pin(keys):
                    pins.append(keys)
            except ValueError:
                pass
        elif kind == "unpin" and pins:
            cache.unpin(pins.pop(op[1] % len(pins)))
        elif kind == "clear":
            cache.clear(None if op[1] < 0 else SCOPES[op[1]].digest)
            pins.clear()
        cache.check_integrity()
        # Every running request still holds its blocks.
        assert all(block.ref_count > 0 for request in running for block in request.blocks)
    for request in running:
        finish(cache, request)
    cache.check_integrity()
    assert cache.usage().num_referenced_blocks == 0


def test_hits_always_carry_the_same_tokens():
    """A deterministic soak: whatever matched must equal the prompt's tokens."""
    rng = random.Random(7)
    cache = RadixCache(64, BS)
    keyer = BlockKeyer(BS, hash_function=lambda data: data[-1:])  # weak hash: collides constantly
    scope = SCOPES[0].digest
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
        request = admit(cache, keyer, FakeRequest(tokens, scope))
        for i, block in enumerate(request.blocks[: request.num_cached_tokens // BS]):
            assert block.token_bytes == bytes(
                bytearray(b for t in tokens[i * BS : (i + 1) * BS] for b in t.to_bytes(4, "little"))
            )
        insert_full_blocks(cache, request)
        finish(cache, request)
        cache.check_integrity()
