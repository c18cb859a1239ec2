"""The KV block record: round trip, header-only reads, and every reason a record is refused."""

from __future__ import annotations

import struct
import zlib

import pytest

from prefixserve.cache import BlockKeyer
from prefixserve.engine.tier_reader import payload_is_finite
from prefixserve.tiers.record import (
    FIXED_HEADER_SIZE,
    REASONS,
    BlockRecord,
    RecordError,
    RecordExpectation,
    decode_record,
    encode_record,
    header_length,
    read_header,
)
from prefixserve.tiers.seal import Keyring, Sealer

SCOPE = bytes(range(32))
SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, kv heads, head dim
PAYLOAD = bytes(i % 251 for i in range(2 * 2 * 4 * 1 * 8 * 4))  # float32
TOKENS = (7, 8, 9, 4_000_000_000)  # the last id needs all 32 bits


def make_record(**changes) -> BlockRecord:
    keyer = BlockKeyer(block_size=4)
    fields = dict(
        key=keyer.block_key(SCOPE, TOKENS),
        parent_key=None,
        scope_digest=SCOPE,
        token_ids=TOKENS,
        dtype="float32",
        shape=SHAPE,
        payload=PAYLOAD,
    )
    fields.update(changes)
    return BlockRecord(**fields)


def expectation(record: BlockRecord, **changes) -> RecordExpectation:
    fields = dict(
        key=record.key,
        scope_digest=record.scope_digest,
        token_ids=record.token_ids,
        dtype=record.dtype,
        shape=record.shape,
    )
    fields.update(changes)
    return RecordExpectation(**fields)


def reason_of(data: bytes, expect: RecordExpectation, sealer=None) -> str:
    with pytest.raises(RecordError) as caught:
        decode_record(data, expect, sealer)
    assert isinstance(caught.value, ValueError)
    return caught.value.reason


@pytest.mark.parametrize("parent_key", [None, b"\x01" * 32])
@pytest.mark.parametrize(
    "dtype,shape", [("float32", SHAPE), ("bfloat16", (2, 2, 4, 2, 8)), ("float16", (4, 2, 4, 1, 8))]
)
def test_round_trip(parent_key, dtype, shape):
    record = make_record(parent_key=parent_key, dtype=dtype, shape=list(shape), token_ids=list(TOKENS))
    assert record.shape == shape and record.token_ids == TOKENS  # lists are frozen into tuples
    data = encode_record(record)
    assert data[:4] == b"PSKV"
    assert decode_record(data, expectation(record)) == record
    # None skips the scope and token checks
    assert decode_record(data, expectation(record, scope_digest=None, token_ids=None)) == record


def test_header_is_read_from_header_bytes_alone():
    record = make_record(parent_key=b"\x02" * 32)
    data = encode_record(record)
    length = header_length(data[:FIXED_HEADER_SIZE])
    assert len(data) == length + len(PAYLOAD)
    header = read_header(data[:length])  # no payload byte present
    assert (header.key, header.parent_key, header.scope_digest, header.token_ids) == (
        record.key,
        record.parent_key,
        SCOPE,
        TOKENS,
    )
    assert (header.dtype, header.shape, header.payload_length, header.header_length) == (
        "float32",
        SHAPE,
        len(PAYLOAD),
        length,
    )
    assert header.record_length == len(data)
    with pytest.raises(RecordError) as caught:
        read_header(data[: length - 1])
    assert caught.value.reason == "truncated"


def test_flipped_payload_byte_is_a_checksum_error_but_the_header_still_reads():
    record = make_record()
    data = bytearray(encode_record(record))
    data[-1] ^= 0x01
    assert reason_of(bytes(data), expectation(record)) == "checksum"
    assert read_header(bytes(data)).key == record.key  # the header checksum covers the header only


@pytest.mark.parametrize("offset", list(range(6, 28)) + [28, 40, 60, 100])
def test_flipped_header_byte_is_refused(offset):
    """Bytes 0-5 are magic and version (tested apart); from 6 on, any flip is caught."""
    record = make_record(parent_key=b"\x03" * 32)
    data = bytearray(encode_record(record))
    assert offset < header_length(bytes(data))
    data[offset] ^= 0x10
    # a flipped length field reads as truncated; anything else fails the checksum
    assert reason_of(bytes(data), expectation(record)) in ("checksum", "truncated")
    if 24 <= offset < 28:  # the record checksum itself: only a whole-record read checks it
        read_header(bytes(data))
        return
    with pytest.raises(RecordError):
        read_header(bytes(data))


def test_truncated_at_every_kind_of_point():
    record = make_record()
    data = encode_record(record)
    length = header_length(data)
    for end in (
        0,
        2,
        4,
        6,
        12,
        FIXED_HEADER_SIZE - 1,
        FIXED_HEADER_SIZE,
        length - 1,
        length,
        length + 1,
        len(data) - 1,
    ):
        assert reason_of(data[:end], expectation(record)) == "truncated", end
    assert reason_of(data + b"\x00", expectation(record)) == "truncated"  # trailing bytes: the length is wrong too


def test_bad_magic_and_version():
    record = make_record()
    data = encode_record(record)
    assert reason_of(b"XSKV" + data[4:], expectation(record)) == "magic"
    assert reason_of(b"P", expectation(record)) == "truncated"  # a prefix of the magic is a short record
    assert reason_of(b"Q", expectation(record)) == "magic"
    future = data[:4] + struct.pack("<H", 3) + data[6:]
    assert reason_of(future, expectation(record)) == "version"


@pytest.mark.parametrize(
    "changes,reason",
    [
        (dict(key=b"\x09" * 32), "key"),
        (dict(scope_digest=b"\x0a" * 32), "scope"),
        (dict(token_ids=(7, 8, 9, 10)), "tokens"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(shape=(2, 2, 4, 8, 1)), "shape"),
    ],
)
def test_expectation_mismatches(changes, reason):
    record = make_record()
    assert reason_of(encode_record(record), expectation(record, **changes)) == reason


def test_every_reason_is_reachable():
    """One damage of each kind, collected: the reasons raised are exactly REASONS."""
    record = make_record()
    data = encode_record(record)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    cases = [
        (b"XSKV" + data[4:], {}),
        (data[:4] + struct.pack("<H", 9) + data[6:], {}),
        (data[:-1], {}),
        (bytes(flipped), {}),
        (data, dict(key=b"\x00" * 32)),
        (data, dict(scope_digest=b"\x00" * 32)),
        (data, dict(token_ids=(0, 0, 0, 0))),
        (data, dict(dtype="float16")),
        (data, dict(shape=(1,))),
    ]
    reasons = [reason_of(bytes(damaged), expectation(record, **changes)) for damaged, changes in cases]
    sealer = Sealer(Keyring.from_secret("s" * 32))
    reasons.append(reason_of(data, expectation(record), sealer))  # unsealed where a seal is required
    nan = make_record(payload=struct.pack("<f", float("nan")) * (len(record.payload) // 4))
    decode_record(encode_record(nan), expectation(nan))  # a record may hold NaN; the engine refuses it:
    if not payload_is_finite(nan.payload, nan.dtype):
        reasons.append("nonfinite")
    assert reasons == list(REASONS)


def test_header_describing_an_impossible_payload_is_refused():
    """A well-formed, checksummed header whose dtype or shape cannot describe its payload (another
    writer's bug, or a future dtype) is refused by reason, not trusted."""
    record = make_record()
    data = bytearray(encode_record(record))
    body_start = FIXED_HEADER_SIZE + struct.calcsize("<BHHHBBI") + len(record.key) + len(SCOPE)
    for patch, reason in ((b"float64", "dtype"), (None, "shape")):
        forged = bytearray(data)
        if patch is not None:
            forged[body_start : body_start + 7] = patch
        else:
            forged[body_start + 7 : body_start + 15] = struct.pack("<Q", 99)
        body = bytes(forged[FIXED_HEADER_SIZE : header_length(bytes(forged))])
        forged[20:24] = struct.pack(
            "<I", zlib.crc32(body, zlib.crc32(bytes(forged[28:FIXED_HEADER_SIZE]), zlib.crc32(bytes(forged[:20]))))
        )
        with pytest.raises(RecordError) as caught:
            read_header(bytes(forged))
        assert caught.value.reason == reason


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(dtype="float64"), "unknown KV dtype"),
        (dict(payload=PAYLOAD[:-1]), "needs"),
        (dict(token_ids=(-1, 0, 0, 0)), "token ids"),
        (dict(parent_key=None, key=SCOPE, scope_digest=SCOPE), None),
    ],
)
def test_encode_refuses_records_that_could_never_decode(changes, message):
    record = make_record(**changes)
    if message is None:  # a key equal to the scope is odd but harmless
        encode_record(record)
        return
    with pytest.raises(ValueError, match=message):
        encode_record(record)


def test_self_parent_is_refused():
    record = make_record()
    with pytest.raises(ValueError, match="own parent"):
        encode_record(make_record(parent_key=record.key))
