"""The prefix KV cache core: pure Python bookkeeping, no torch."""

from .block_pool import Block, BlockPool, FreeBlockList
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, KVEvent, event_from_dict, event_to_dict
from .keys import HASH_FUNCTIONS, BlockKeyer, CacheScope, max_hit_blocks, pack_tokens
from .radix import MatchResult, OutOfBlocksError, RadixCache
from .stats import CacheStats, CacheUsage

__all__ = [
    "AllBlocksCleared",
    "Block",
    "BlockKeyer",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheScope",
    "CacheStats",
    "CacheUsage",
    "EventQueue",
    "FreeBlockList",
    "HASH_FUNCTIONS",
    "KVEvent",
    "MatchResult",
    "OutOfBlocksError",
    "RadixCache",
    "event_from_dict",
    "event_to_dict",
    "max_hit_blocks",
    "pack_tokens",
]
