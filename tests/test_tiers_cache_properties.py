"""The cache core's property test with a host tier under it: random interleavings of admissions,
inserts, finishes, evictions that spill into the tier, and fetches that promote records back keep
every invariant of the pool and of the tier, and a promoted block always holds its own tokens."""

from cache_helpers import FakeRequest, finish, insert_full_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache
from prefixserve.cache.keys import pack_tokens, unpack_tokens
from prefixserve.tiers import BlockRecord, HostTier, RecordExpectation, decode_record

BS = 4
SCOPE = CacheScope("model", "tokenizer")
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7]]
SHAPE = (BS,)  # the "KV" of a block is its own tokens, as uint32: a promoted block can be checked exactly


class Pool:
    """A RadixCache whose evicted blocks spill into a HostTier, with the KV of each slot kept in a dict."""

    def __init__(self, num_blocks: int, host_bytes: int) -> None:
        self.cache = RadixCache(num_blocks, BS)
        self.keyer = BlockKeyer(BS)
        self.host = HostTier(host_bytes)
        self.slots: dict[int, bytes] = {}  # block id -> "KV" written there
        self.cache.on_evict = self.spill

    def spill(self, block) -> None:
        parent = block.parent
        self.host.put(
            [
                BlockRecord(
                    block.key,
                    getattr(parent, "key", None),
                    SCOPE.digest,
                    tuple(unpack_tokens(block.token_bytes)),
                    "float32",
                    SHAPE,
                    self.slots[block.block_id],
                )
            ]
        )

    def admit(self, tokens: list[int], num_output_slots: int):
        """Match on the device, promote what the host holds next, then admit; None when it cannot fit."""
        request = FakeRequest(tokens, SCOPE.digest)
        keys = self.keyer.extend(request.keys, request.scope_digest, tokens)
        limit = (len(tokens) - 1) // BS
        hit = self.cache.match(SCOPE.digest, keys[:limit], tokens, record_stats=False).blocks
        self.promote(request, hit, keys[len(hit) : limit])
        hit = self.cache.match(SCOPE.digest, keys[:limit], tokens, record_stats=False).blocks
        needed = -(-(len(tokens) + num_output_slots) // BS) - len(hit)
        blocks = self.cache.admit(hit, needed)
        if blocks is None:
            return None
        request.blocks = blocks
        for index, block in enumerate(blocks):
            if index >= len(hit):  # "compute" the new blocks' KV
                self.slots[block.block_id] = pack_tokens(tokens[index * BS : (index + 1) * BS] + [0] * BS)[: 4 * BS]
        return request

    def promote(self, request, hit, keys) -> None:
        run = self.host.contains(keys)
        if not run:
            return
        payloads = []
        for index, (key, data) in enumerate(zip(keys[:run], self.host.get(keys[:run]))):
            position = len(hit) + index
            tokens = tuple(request.token_ids[position * BS : (position + 1) * BS])
            payloads.append(decode_record(data, RecordExpectation(key, SCOPE.digest, tokens, "float32", SHAPE)).payload)
        blocks = self.cache.admit(hit, len(payloads))
        if blocks is None:
            return
        parent = hit[-1] if hit else SCOPE.digest
        for index, payload in enumerate(payloads):
            position = len(hit) + index
            block = blocks[position]
            self.slots[block.block_id] = payload
            blocks[position] = parent = self.cache.insert(
                block, keys[index], request.token_ids[position * BS : (position + 1) * BS], parent
            )
        self.cache.release(blocks)

    def check(self, running) -> None:
        self.cache.check_integrity()
        self.host.check_integrity()
        for request in running:  # every cached block a request holds carries its own tokens' "KV"
            for index, block in enumerate(request.blocks[: len(request.token_ids) // BS]):
                if block.key is not None:
                    expected = pack_tokens(request.token_ids[index * BS : (index + 1) * BS])
                    assert self.slots[block.block_id] == expected, f"block {index} holds another block's KV"


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 5)),
        st.tuples(st.just("insert"), st.integers(0, 10)),
        st.tuples(st.just("finish"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 14)),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(6, 14), st.integers(1, 8))
def test_spills_and_fetches_keep_every_tier_consistent(ops, num_blocks, host_records):
    pool = Pool(num_blocks, host_bytes=host_records * 200)
    running = []
    for op in ops:
        if op[0] == "admit":
            _, stem, extra, output = op
            request = pool.admit(STEMS[stem] + [100 + extra] * (extra + 1), output)
            if request is not None:
                insert_full_blocks(pool.cache, request)  # its prefill ran
                running.append(request)
        elif op[0] == "insert" and running:
            insert_full_blocks(pool.cache, running[op[1] % len(running)])
        elif op[0] == "finish" and running:
            finish(pool.cache, running.pop(op[1] % len(running)))
        elif op[0] == "evict":
            pool.cache.evict(op[1])
        pool.check(running)
