"""A minimal request life cycle over the cache core, as the engine drives it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from prefixserve.cache import Block, BlockKeyer, RadixCache
from prefixserve.cache.radix import OutOfBlocksError


@dataclass
class FakeRequest:
    token_ids: list[int]
    scope_digest: bytes
    blocks: list[Block] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    owner: Optional[str] = None  # the tenant whose shares its blocks count against


def admit(
    cache: RadixCache, keyer: BlockKeyer, request: FakeRequest, num_output_slots: int = 0, ttl: Optional[float] = None
) -> FakeRequest:
    """Match, acquire the hit, allocate blocks for the rest of the prompt plus output slots."""
    keyer.extend(request.keys, request.scope_digest, request.token_ids)
    hit = cache.match(request.scope_digest, request.keys, request.token_ids)
    total_slots = len(request.token_ids) + num_output_slots
    num_needed = -(-total_slots // cache.block_size) - len(hit.blocks)
    blocks = cache.admit(hit.blocks, num_needed, ttl, request.owner)
    if blocks is None:
        raise OutOfBlocksError(f"cannot admit: {num_needed} new blocks plus the hit do not fit")
    request.blocks = blocks
    request.num_cached_tokens = hit.num_tokens
    return request


def insert_full_blocks(cache: RadixCache, request: FakeRequest, ttl: Optional[float] = None) -> None:
    """After 'computing' the KV: register every full block (merging duplicates)."""
    size = cache.block_size
    for i, key in enumerate(request.keys):
        parent = request.blocks[i - 1] if i else request.scope_digest
        request.blocks[i] = cache.insert(
            request.blocks[i], key, request.token_ids[i * size : (i + 1) * size], parent, ttl, owner=request.owner
        )


def finish(cache: RadixCache, request: FakeRequest) -> None:
    cache.release(request.blocks)
    request.blocks = []
