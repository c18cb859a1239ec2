"""One self-describing, checksummed and (with a fleet secret) sealed record per KV block: the bytes
every tier stores.

    offset  size  field
    0       4     magic b"PSKV"
    4       2     format version (2), little-endian like every integer here
    6       2     seal: 0 none, 1 AES-256-GMAC, 2 AES-256-GCM (seal.py)
    8       4     body length B
    12      8     payload length P: the bytes stored (under GCM the ciphertext of token ids and KV)
    20      4     header checksum: CRC-32 of bytes [0, 20), of [28, 52) and of the body
    24      4     record checksum: CRC-32 of the payload seeded with the header checksum (seal 0 only)
    28      8     key id of the sealing secret (zeros when unsealed)
    36      16    salt the record's key is derived from (zeros when unsealed)
    52      B     body: key, parent key, scope digest, dtype, shape, token count, token ids (none under GCM)
    52+B    P     payload: the block's K/V as `shape` and `dtype` lay it out (or its ciphertext)
    52+B+P  16    tag (sealed records only): GMAC over everything before it, or GCM's over the header

Two checksums so a disk tier can rebuild its index from headers alone (the header
one) while a read still covers header and payload together (the record one).
CRC-32 finds damage (bit rot, torn or truncated files, a record copied in under
the wrong name), not a forger: anyone can compute it. Only a seal does that, and
a sealed record skips the payload CRC, since the tag finds damage as well.
CRC-32 (zlib) runs at about 5.9 GB/s here, BLAKE2b at 1.1 GB/s; seal.py says why
the seal is GMAC. The key, scope and token ids are compared on every read besides,
so a genuine record under the wrong name (a replay) is a miss.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Optional

from ..cache.keys import pack_tokens
from .seal import GCM, KEY_ID_SIZE, SALT_SIZE, SEALS, TAG_SIZE, UNSEALED, Sealer, SealError

MAGIC = b"PSKV"
FORMAT_VERSION = 2
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
# auth: unsealed where a seal is required, sealed where none can be checked, or a seal that fails.
# nonfinite: NaN or infinity in the KV (checked by the engine before the payload reaches the pool).
REASONS = ("magic", "version", "truncated", "checksum", "key", "scope", "tokens", "dtype", "shape", "auth", "nonfinite")

_PREFIX = struct.Struct("<4sHHIQ")  # magic, version, seal, body length, payload length
_CHECKSUMS = struct.Struct("<II")  # header checksum, record checksum
_SEAL_FIELDS = struct.Struct(f"<{KEY_ID_SIZE}s{SALT_SIZE}s")  # key id, salt
_CHECKSUMS_AT = _PREFIX.size
_SEAL_AT = _CHECKSUMS_AT + _CHECKSUMS.size
FIXED_HEADER_SIZE = _SEAL_AT + _SEAL_FIELDS.size  # 52: enough to learn the whole header's length
_BODY = struct.Struct("<BHHHBBI")  # has parent, key, parent, scope, dtype lengths, ndim, num tokens
_HAS_PARENT = 1


class RecordError(ValueError):
    """A record that must not reach the KV pool; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class BlockRecord:
    key: bytes
    parent_key: Optional[bytes]  # None for block 0, whose parent is the scope digest
    scope_digest: bytes
    token_ids: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, ...]  # e.g. (num_layers, 2, block_size, num_kv_heads, head_dim)
    payload: bytes
    # The scope its tenant's chain hangs from (a request's salted scope, or the private one past a shared
    # prefix): what a GCM seal's key commits to. Not stored; the reader supplies its own.
    tenant_scope: bytes = b""
    # The tenant whose share of a tier it counts against (its block's owner). Not stored either: a record a
    # disk tier indexes at start-up is nobody's until its tenant writes it again.
    owner: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "shape", tuple(self.shape))


@dataclass(frozen=True)
class RecordHeader:
    """Everything in a record but its payload."""

    key: bytes
    parent_key: Optional[bytes]
    scope_digest: bytes
    token_ids: Optional[tuple[int, ...]]  # None under GCM: encrypted with the payload
    dtype: str
    shape: tuple[int, ...]
    payload_length: int
    header_length: int  # fixed part + body: where the payload starts
    seal: int = UNSEALED
    key_id: bytes = bytes(KEY_ID_SIZE)
    salt: bytes = bytes(SALT_SIZE)

    @property
    def record_length(self) -> int:
        return self.header_length + self.payload_length + (TAG_SIZE if self.seal != UNSEALED else 0)


@dataclass(frozen=True)
class RecordExpectation:
    """What a reader needs a record to be; None skips that check."""

    key: bytes
    scope_digest: Optional[bytes]
    token_ids: Optional[tuple[int, ...]]
    dtype: str
    shape: tuple[int, ...]
    tenant_scope: bytes = b""  # the scope a GCM-sealed record's key must commit to (BlockRecord.tenant_scope)


def encode_record(record: BlockRecord, sealer: Optional[Sealer] = None) -> bytes:
    """The record's bytes, sealed when a sealer is given; raises ValueError for a record that could never
    decode (a caller's bug)."""
    _validate(record)
    dtype = record.dtype.encode("ascii")
    parent = record.parent_key or b""
    try:
        tokens = pack_tokens(record.token_ids)
    except OverflowError:
        raise ValueError(f"token ids must fit in 0..2**32-1, got {record.token_ids}") from None
    seal = UNSEALED if sealer is None else sealer.seal
    body = b"".join(
        (
            _BODY.pack(
                _HAS_PARENT if record.parent_key is not None else 0,
                len(record.key),
                len(parent),
                len(record.scope_digest),
                len(dtype),
                len(record.shape),
                len(record.token_ids),
            ),
            record.key,
            parent,
            record.scope_digest,
            dtype,
            struct.pack(f"<{len(record.shape)}Q", *record.shape),
            b"" if seal == GCM else tokens,
        )
    )
    payload_length = len(record.payload) + (len(tokens) if seal == GCM else 0)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, seal, len(body), payload_length)
    seal_fields = _SEAL_FIELDS.pack(
        *(bytes(KEY_ID_SIZE), bytes(SALT_SIZE))
        if sealer is None
        else (sealer.keyring.sealing.key_id, sealer.new_salt())
    )
    header_checksum = zlib.crc32(body, zlib.crc32(seal_fields, zlib.crc32(prefix)))
    if sealer is None:
        checksums = _CHECKSUMS.pack(header_checksum, zlib.crc32(record.payload, header_checksum))
        return b"".join((prefix, checksums, seal_fields, body, record.payload))
    header = b"".join((prefix, _CHECKSUMS.pack(header_checksum, 0), seal_fields, body))
    salt = seal_fields[KEY_ID_SIZE:]
    if seal == GCM:
        return header + sealer.encrypt(salt, record.tenant_scope, header, tokens + record.payload)
    return b"".join((header, record.payload, sealer.tag(salt, header, record.payload)))


def header_length(data: bytes) -> int:
    """Length of the whole header, from its first FIXED_HEADER_SIZE bytes (a reader's second read)."""
    _check_prefix(data)
    return FIXED_HEADER_SIZE + _PREFIX.unpack_from(data)[3]


def read_header(data: bytes) -> RecordHeader:
    """The header of a record from the record's leading bytes; the payload need not be there."""
    _check_prefix(data)
    _, _, _, body_length, payload_length = _PREFIX.unpack_from(data)
    end = FIXED_HEADER_SIZE + body_length
    if len(data) < end:
        raise RecordError("truncated", f"header needs {end} bytes, got {len(data)}")
    header_checksum, _ = _CHECKSUMS.unpack_from(data, _CHECKSUMS_AT)
    view = memoryview(data)
    expected = zlib.crc32(
        view[FIXED_HEADER_SIZE:end], zlib.crc32(view[_SEAL_AT:FIXED_HEADER_SIZE], zlib.crc32(view[: _PREFIX.size]))
    )
    if expected != header_checksum:
        raise RecordError("checksum", "header checksum does not match: the header is damaged")
    seal = _PREFIX.unpack_from(data)[2]
    if seal not in SEALS:
        raise RecordError("version", f"record has seal {seal}, this build knows {SEALS}")
    key_id, salt = _SEAL_FIELDS.unpack_from(data, _SEAL_AT)
    return _parse_body(view[FIXED_HEADER_SIZE:end], payload_length, end, seal, key_id, salt)


def decode_record(data: bytes, expect: RecordExpectation, sealer: Optional[Sealer] = None) -> BlockRecord:
    """Verify a whole record against `expect` and return it; RecordError names what is wrong.

    With a sealer only records sealed under one of its secrets pass; without one, only unsealed records."""
    header = read_header(data)
    if len(data) != header.record_length:
        raise RecordError("truncated", f"record is {len(data)} bytes, its header says {header.record_length}")
    view = memoryview(data)
    payload = view[header.header_length : header.header_length + header.payload_length]
    if sealer is None:
        if header.seal != UNSEALED:
            raise RecordError(
                "auth",
                "the record is sealed and this replica has no secret to check it: give it "
                "the fleet's kv_tier_secret_file",
            )
        header_checksum, record_checksum = _CHECKSUMS.unpack_from(data, _CHECKSUMS_AT)
        if zlib.crc32(payload, header_checksum) != record_checksum:
            raise RecordError("checksum", "record checksum does not match: the payload is damaged")
    elif header.seal == UNSEALED:
        raise RecordError("auth", "the record is not sealed, and this replica accepts only sealed records")
    _check_expectation(header, expect)  # cheap before the seal's pass; the seal then vouches for all of it
    token_ids = header.token_ids
    if sealer is not None:
        header_bytes = view[: header.header_length]
        try:
            plaintext = sealer.open(
                header.seal,
                header.key_id,
                header.salt,
                expect.tenant_scope,
                header_bytes,
                view[header.header_length :] if header.seal == GCM else payload,
                view[header.header_length + header.payload_length :],
            )
        except SealError as error:
            raise RecordError("auth", str(error)) from None
        if plaintext is not None:  # GCM: token ids, then the KV
            num_token_bytes = header.payload_length - _kv_bytes(header)
            tokens = array("I")
            tokens.frombytes(plaintext[:num_token_bytes])
            if sys.byteorder == "big":
                tokens.byteswap()
            token_ids = tuple(tokens)
            if expect.token_ids is not None and token_ids != tuple(expect.token_ids):
                raise RecordError("tokens", "record holds other token ids under this key (a hash collision)")
            payload = memoryview(plaintext)[num_token_bytes:]
    return BlockRecord(
        header.key,
        header.parent_key,
        header.scope_digest,
        token_ids,
        header.dtype,
        header.shape,
        bytes(payload),
        expect.tenant_scope,
    )


def _kv_bytes(header: RecordHeader) -> int:
    return math.prod(header.shape) * DTYPE_SIZES[header.dtype]


def _validate(record: BlockRecord) -> None:
    if record.dtype not in DTYPE_SIZES:
        raise ValueError(f"unknown KV dtype {record.dtype!r}; records hold one of {sorted(DTYPE_SIZES)}")
    expected = math.prod(record.shape) * DTYPE_SIZES[record.dtype]
    if len(record.payload) != expected:
        raise ValueError(
            f"payload is {len(record.payload)} bytes, shape {record.shape} of {record.dtype} needs {expected}"
        )
    if record.parent_key == record.key:
        raise ValueError("a record cannot be its own parent")
    for name in ("key", "parent_key", "scope_digest"):
        value = getattr(record, name) or b""
        if len(value) > 0xFFFF:
            raise ValueError(f"{name} is {len(value)} bytes, at most 65535 fit")
    if len(record.shape) > 0xFF or any(not 0 <= dim < 1 << 63 for dim in record.shape):
        raise ValueError(f"shape {record.shape} does not fit a record")


def _check_prefix(data: bytes) -> None:
    if bytes(data[: len(MAGIC)]) != MAGIC[: len(data)]:
        raise RecordError("magic", "not a prefixserve KV record (bad magic)")
    if len(data) < _PREFIX.size:
        raise RecordError("truncated", f"record ends at byte {len(data)}, inside its fixed header")
    version = _PREFIX.unpack_from(data)[1]
    if version != FORMAT_VERSION:
        raise RecordError("version", f"record format version {version}, this build reads {FORMAT_VERSION}")
    if len(data) < FIXED_HEADER_SIZE:
        raise RecordError("truncated", f"record ends at byte {len(data)}, inside its fixed header")


def _parse_body(
    body: memoryview, payload_length: int, header_length_: int, seal: int, key_id: bytes, salt: bytes
) -> RecordHeader:
    # The header checksum passed, so an inconsistent body was written that way; say "truncated".
    if len(body) < _BODY.size:
        raise RecordError("truncated", "header body is shorter than its fixed fields")
    flags, key_len, parent_len, scope_len, dtype_len, ndim, num_tokens = _BODY.unpack_from(body)
    offset = _BODY.size
    fields = []
    encrypted = seal == GCM  # token ids travel in the ciphertext
    for length in (key_len, parent_len, scope_len, dtype_len, 8 * ndim, 0 if encrypted else 4 * num_tokens):
        fields.append(bytes(body[offset : offset + length]))
        offset += length
    if offset != len(body):
        raise RecordError("truncated", f"header body holds {len(body)} bytes, its fields {offset}")
    key, parent, scope, dtype_bytes, shape_bytes, token_bytes = fields
    dtype = dtype_bytes.decode("ascii", "replace")
    shape = struct.unpack(f"<{ndim}Q", shape_bytes)
    tokens = array("I")
    tokens.frombytes(token_bytes)
    if sys.byteorder == "big":
        tokens.byteswap()
    if dtype not in DTYPE_SIZES:
        raise RecordError("dtype", f"record holds unknown dtype {dtype!r}")
    if math.prod(shape) * DTYPE_SIZES[dtype] + (4 * num_tokens if encrypted else 0) != payload_length:
        raise RecordError("shape", f"shape {shape} of {dtype} does not match a {payload_length}-byte payload")
    return RecordHeader(
        key,
        parent if flags & _HAS_PARENT else None,
        scope,
        None if encrypted else tuple(tokens),
        dtype,
        shape,
        payload_length,
        header_length_,
        seal,
        key_id,
        salt,
    )


def _check_expectation(header: RecordHeader, expect: RecordExpectation) -> None:
    if header.key != expect.key:
        raise RecordError("key", f"record holds block {header.key.hex()[:16]}, not {expect.key.hex()[:16]}")
    if expect.scope_digest is not None and header.scope_digest != expect.scope_digest:
        raise RecordError("scope", "record was computed in another scope (model, tokenizer, adapter or tenant)")
    if expect.token_ids is not None and header.token_ids is not None and header.token_ids != tuple(expect.token_ids):
        raise RecordError("tokens", "record holds other token ids under this key (a hash collision)")
    if header.dtype != expect.dtype:
        raise RecordError("dtype", f"record holds {header.dtype}, the pool needs {expect.dtype}")
    if header.shape != tuple(expect.shape):
        raise RecordError("shape", f"record has shape {header.shape}, the pool needs {tuple(expect.shape)}")
