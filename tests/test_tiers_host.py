"""The host-RAM tier: exact leaf-first LRU order, leading runs, capacity, counters, threads."""

from __future__ import annotations

import logging
import threading

import pytest
from tier_helpers import expect, make_chain, run_in_threads, size

from prefixserve.tiers import BlockRecord, HostTier, decode_record, encode_record


def names(tier, named: dict[str, BlockRecord]) -> set[str]:
    present = set(tier.keys())
    return {name for name, record in named.items() if record.key in present}


def test_leaf_first_lru_exact_order():
    """A shared prefix p0-p1 with tails a2, b2: tails go first, the prefix when it is a leaf and oldest."""
    prefix = list(range(8))
    p0, p1, a2 = make_chain(prefix + [100, 101, 102, 103])
    b2 = make_chain(prefix + [200, 201, 202, 203])[2]
    c0, c1 = make_chain(list(range(300, 308)))
    d0 = make_chain(list(range(400, 404)))[0]
    named = dict(p0=p0, p1=p1, a2=a2, b2=b2, c0=c0, c1=c1, d0=d0)
    tier = HostTier(capacity_bytes=size(p0) + size(p1) + size(a2) + size(b2))
    tier.put([p0, p1, a2])
    tier.put([b2])
    assert names(tier, named) == {"p0", "p1", "a2", "b2"} and tier.used_bytes == tier.capacity_bytes
    tier.put([c0])  # leaves a2, b2, c0: a2 is the oldest (p0 is older, but a parent)
    assert names(tier, named) == {"p0", "p1", "b2", "c0"}
    tier.put([c1])  # leaves b2, c1 (c0 is a parent now): b2
    assert names(tier, named) == {"p0", "p1", "c0", "c1"}
    assert [data is not None for data in tier.get([p0.key, p1.key])] == [True, True]  # refreshes p1
    tier.put([d0])  # leaves p1 (just read), c1: c1
    assert names(tier, named) == {"p0", "p1", "c0", "d0"}
    tier.put([c1])  # c0 is a parent again; leaves p1, d0, c1: p1, read before d0 was put
    assert names(tier, named) == {"p0", "c0", "d0", "c1"}
    tier.put([a2])  # an orphan now (p1 is gone); leaves p0, d0, c1, a2: p0 is the oldest
    assert names(tier, named) == {"c0", "d0", "c1", "a2"}
    assert tier.stats.evictions == 5
    tier.check_integrity()


def test_contains_is_the_leading_run():
    chain = make_chain(list(range(20)))  # 5 blocks
    tier = HostTier(1 << 20)
    tier.put(chain[:2] + chain[3:])
    keys = [record.key for record in chain]
    assert tier.contains(keys) == 2
    assert tier.contains(keys[3:]) == 2
    assert tier.contains([]) == 0
    assert tier.contains([b"missing"] + keys) == 0
    stats = tier.stats
    assert (stats.hits, stats.misses, stats.bytes_read) == (0, 0, 0)  # a probe is not a hit, a miss or a read


def test_get_returns_records_that_verify_and_counts():
    chain = make_chain(list(range(12)))
    tier = HostTier(1 << 20)
    tier.put(chain)
    results = tier.get([chain[0].key, b"absent", chain[2].key])
    assert results[1] is None
    assert decode_record(results[0], expect(chain[0])) == chain[0]
    assert decode_record(results[2], expect(chain[2])) == chain[2]
    stats = tier.stats
    assert (stats.hits, stats.misses) == (2, 1)
    assert stats.bytes_read == size(chain[0]) + size(chain[2])
    assert stats.bytes_written == sum(size(record) for record in chain) == tier.used_bytes
    assert tier.fetch([chain[1].key]).result() == [encode_record(chain[1])]


def test_capacity_drops_what_cannot_fit_and_never_raises():
    chain = make_chain(list(range(8)), payload_bytes=256)
    tier = HostTier(capacity_bytes=size(chain[0]) - 1)
    tier.put(chain)
    assert tier.keys() == [] and tier.used_bytes == 0
    assert tier.stats.dropped_puts == 2
    empty = HostTier(0)
    empty.put(chain)
    assert empty.stats.dropped_puts == 2
    with pytest.raises(ValueError, match="capacity_bytes >= 0"):
        HostTier(-1)


def test_a_chain_longer_than_the_tier_keeps_its_prefix():
    """A 5-block chain into a tier that holds 3: each new block makes its parent a non-leaf, so when
    room runs out the only leaf is the newest block itself, and the tail is dropped, not the prefix.
    Block 4, whose parent was just dropped, is dropped too rather than pushing out block 2."""
    chain = make_chain(list(range(20)))
    tier = HostTier(capacity_bytes=size(chain[0]) + 2 * size(chain[1]))
    tier.put(chain)
    assert tier.contains([record.key for record in chain]) == 3 and len(tier.keys()) == 3
    assert (tier.stats.evictions, tier.stats.dropped_puts) == (0, 2)
    tier.check_integrity()


def test_put_of_a_present_key_refreshes_without_rewriting():
    chain = make_chain(list(range(8)))
    tier = HostTier(1 << 20)
    tier.put(chain)
    tier.put(chain)
    assert tier.stats.bytes_written == sum(size(record) for record in chain)
    assert tier.used_bytes == sum(size(record) for record in chain)


def test_delete_and_reject(caplog):
    chain = make_chain(list(range(12)))
    tier = HostTier(1 << 20)
    tier.put(chain)
    tier.delete([chain[2].key, b"absent"])
    assert tier.contains([record.key for record in chain]) == 2
    with caplog.at_level(logging.WARNING, logger="prefixserve.tiers"):
        tier.reject(chain[1].key, "checksum")
        tier.reject(chain[0].key, "checksum")
    assert tier.keys() == [] and tier.stats.rejected_records == 2
    assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 1  # logged once per reason
    tier.check_integrity()


def test_concurrent_puts_and_gets_from_several_threads():
    num_threads, num_chains = 4, 12
    chains = [
        make_chain([thread * 10_000 + c * 100 + t for t in range(16)])
        for thread in range(num_threads)
        for c in range(num_chains)
    ]
    shared = make_chain(list(range(16)))  # every thread puts and reads this one too
    tier = HostTier(capacity_bytes=20 * size(shared[1]))  # far less than the ~200 records put
    barrier = threading.Barrier(num_threads)

    def work(thread: int) -> None:
        barrier.wait()
        for chain in chains[thread * num_chains : (thread + 1) * num_chains]:
            for batch in (shared, chain):
                tier.put(batch)
                for record, data in zip(batch, tier.get([record.key for record in batch])):
                    if data is not None:
                        assert decode_record(data, expect(record)) == record
                tier.contains([record.key for record in batch])

    assert run_in_threads(work, range(num_threads)) == []
    tier.check_integrity()
    stats = tier.stats
    assert stats.hits + stats.misses == num_threads * num_chains * 8
    assert tier.used_bytes <= tier.capacity_bytes
