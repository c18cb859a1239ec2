"""Random put/get/delete/evict interleavings on every tier, against a plain leaf-first LRU model.

After each step: check_integrity(), the tier holds exactly the model's keys and bytes,
contains() gives the model's leading runs, every record read back verifies, and no
record left while a child of it stayed.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import SCOPE, make_chain

from prefixserve.tiers import BlockRecord, DiskTier, HostTier, RecordExpectation, decode_record, encode_record

# Few stems so chains share prefixes and branch: 0 and 1 share two blocks, 2 and 3 share one.
STEMS = [list(range(20)), list(range(8)) + [50] * 12, [7] * 16, [7] * 4 + [9] * 8]


CHAINS = [make_chain(stem, payload_bytes=32) for stem in STEMS]
SIZE = {record.key: len(encode_record(record)) for chain in CHAINS for record in chain}
RECORDS = {record.key: record for chain in CHAINS for record in chain}


class LeafFirstModel:
    """The specification, written the slow and obvious way."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: "OrderedDict[bytes, Optional[bytes]]" = OrderedDict()  # key -> parent, least recent first

    @property
    def used(self) -> int:
        return sum(SIZE[key] for key in self.order)

    def is_leaf(self, key: bytes) -> bool:
        return all(parent != key for parent in self.order.values())

    def put(self, records: list[BlockRecord]) -> None:
        dropped: set[bytes] = set()
        for record in records:
            if record.parent_key in dropped or SIZE[record.key] > self.capacity:
                dropped.add(record.key)
            elif record.key in self.order:
                self.order.move_to_end(record.key)
            else:
                self.order[record.key] = record.parent_key
                while self.used > self.capacity:
                    victim = next(key for key in self.order if self.is_leaf(key))
                    del self.order[victim]
                    if victim == record.key:
                        dropped.add(record.key)

    def get(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self.order:
                self.order.move_to_end(key)

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self.order.pop(key, None)


span = st.tuples(st.integers(0, len(CHAINS) - 1), st.integers(0, 4), st.integers(1, 5))
operation = st.one_of(
    st.tuples(st.just("put"), span),
    st.tuples(st.just("get"), span),
    st.tuples(st.just("delete"), span),
    st.tuples(st.just("contains"), span),
)


def records_of(chain: int, start: int, length: int) -> list[BlockRecord]:
    return CHAINS[chain][start : start + length]


def run_and_check(tier, operations, capacity: int) -> None:
    model = LeafFirstModel(capacity)
    for kind, (chain, start, length) in operations:
        records = records_of(chain, start, length)
        keys = [record.key for record in records]
        before = set(tier.keys())
        if kind == "put":
            tier.put(records)
            model.put(records)
        elif kind == "get":
            for record, data in zip(records, tier.get(keys)):
                if data is not None:
                    assert (
                        decode_record(data, RecordExpectation(record.key, SCOPE, record.token_ids, "float32", (8,)))
                        == record
                    )
            model.get(keys)
        elif kind == "delete":
            tier.delete(keys)
            model.delete(keys)
        tier.check_integrity()
        after = set(tier.keys())
        assert after == set(model.order), f"after {kind}: tier and model disagree"
        assert tier.used_bytes == model.used
        assert tier.contains([record.key for record in CHAINS[chain]]) == next(
            (i for i, record in enumerate(CHAINS[chain]) if record.key not in model.order), len(CHAINS[chain])
        )
        if kind == "put":  # leaf-first, stated without the model: nothing left while its child stayed
            present_parents = {RECORDS[key].parent_key for key in after}
            assert not (before - after) & present_parents


capacity_in_records = st.integers(0, 12)
settings_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@settings(max_examples=200, **settings_common)
@given(st.lists(operation, min_size=1, max_size=40), capacity_in_records)
def test_host_tier_matches_the_model(operations, num_records):
    capacity = num_records * max(SIZE.values())
    run_and_check(HostTier(capacity), operations, capacity)


@settings(max_examples=40, **settings_common)
@given(st.lists(operation, min_size=1, max_size=25), capacity_in_records)
def test_disk_tier_matches_the_model(operations, num_records):
    capacity = num_records * max(SIZE.values())
    with tempfile.TemporaryDirectory() as directory:
        with DiskTier(directory, capacity) as tier:
            run_and_check(tier, operations, capacity)


@pytest.mark.parametrize("capacity_records", [1, 3])
def test_model_agrees_on_a_fixed_sequence(capacity_records):
    """A hand-written sequence through both tiers, so a model bug cannot hide behind random draws."""
    capacity = capacity_records * max(SIZE.values())
    operations = [
        ("put", (0, 0, 5)),
        ("put", (1, 0, 5)),
        ("get", (0, 0, 2)),
        ("put", (2, 0, 4)),
        ("delete", (1, 2, 1)),
        ("put", (3, 0, 3)),
    ]
    run_and_check(HostTier(capacity), operations, capacity)
    with tempfile.TemporaryDirectory() as directory:
        with DiskTier(directory, capacity) as tier:
            run_and_check(tier, operations, capacity)
