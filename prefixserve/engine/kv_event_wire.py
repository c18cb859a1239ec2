"""vLLM's KV events on the wire: its msgspec structs (written from vLLM 0.32's published schema, field order
and options included: the order is the format) and our cache events translated into them.

    ZMQ multipart:  topic | sequence number (8 bytes, big-endian) | msgpack payload
    payload:        KVEventBatch as an array  [ts, [event, ...], data_parallel_rank]
    event:          a map tagged "type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"

What we fill in, beyond vLLM's own meaning of each field:
- block_hashes / parent_block_hash: the low 64 bits of our chained block keys (vLLM's int hashes). They are
  ours, not vLLM's: a consumer that matches by hash must take them from these events, and one that
  recomputes keys (vllm-router, llm-d's indexer) recomputes from token_ids.
- extra_keys: per block, a digest of the scope its chain hangs from (model + tokenizer + tenant/salt), never
  a raw salt, so a scorer that recomputes keys with extra_keys keeps two tenants' blocks apart.
- medium and locality: the pool is "GPU" (vLLM's name for the first tier, whatever the device), host RAM
  "CPU", disk "STORAGE", all LOCAL. A lower tier reports keys only (token_ids empty, as vLLM's offloading
  connector does).

msgspec is an optional dependency (pip install 'prefixserve[kv-events]'): this module imports it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Optional, Union

import msgspec

from ..cache.events import AllBlocksCleared as CacheAllBlocksCleared
from ..cache.events import BlockRemoved as CacheBlockRemoved
from ..cache.events import BlockStored as CacheBlockStored
from ..cache.events import KVEvent

# our tier's medium (cache/events.py, tiers/*.py traits) -> vLLM's medium
MEDIA = {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE"}
LOCAL = "LOCAL"
_SCOPE_DOMAIN = b"prefixserve-kv-event-scope\x00"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the three events: a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def external_hash(key: bytes) -> int:
    """A block key as vLLM's int ExternalBlockHash: its low 64 bits, as vLLM takes them from its sha256."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def scope_tag(scope: bytes) -> str:
    """What extra_keys says of a scope: a digest of the scope digest (the raw salt never leaves)."""
    return hashlib.sha256(_SCOPE_DOMAIN + scope).hexdigest()[:32]


class WireTranslator:
    """Our cache events -> vLLM's structs, remembering each scope's tag (a replica serves few scopes)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._tags: dict[bytes, str] = {}

    def _extra_keys(self, event: CacheBlockStored) -> Optional[list]:
        if event.scope is None:
            return None
        tag = self._tags.get(event.scope)
        if tag is None:
            if len(self._tags) > 4096:  # bounded: tenants come and go
                self._tags.clear()
            tag = self._tags[event.scope] = scope_tag(event.scope)
        return [(tag,)] * len(event.keys)

    def event(self, event: KVEvent) -> KVCacheEvent:
        if isinstance(event, CacheBlockStored):
            return BlockStored(
                block_hashes=[external_hash(key) for key in event.keys],
                parent_block_hash=None if event.parent_key is None else external_hash(event.parent_key),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=MEDIA.get(event.medium, event.medium),
                lora_name=event.lora_name,
                extra_keys=self._extra_keys(event),
                locality=LOCAL,
            )
        if isinstance(event, CacheBlockRemoved):
            return BlockRemoved(
                block_hashes=[external_hash(key) for key in event.keys],
                medium=MEDIA.get(event.medium, event.medium),
                locality=LOCAL,
            )
        if isinstance(event, CacheAllBlocksCleared):
            return AllBlocksCleared()
        raise TypeError(f"not a KV cache event: {event!r}")

    def batch(self, events: list[KVEvent], ts: Optional[float] = None) -> KVEventBatch:
        return KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=[self.event(event) for event in events],
            data_parallel_rank=self.data_parallel_rank,
        )


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of our own batches (tests, and the replay check); vLLM's classes decode them the same way."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)
