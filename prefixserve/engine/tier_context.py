"""What the reader and the writer of the tiers below one engine's pool share: the tiers, the pool they fill,
the shape of a record, the model's scope, and the measured prefill cost the fetch planner weighs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..cache import Block, BlockKeyer, RadixCache
from ..cache.keys import unpack_tokens
from ..tiers import BlockRecord, KVTier
from ..tiers.record import DTYPE_SIZES
from .runner import ModelRunner

DEFAULT_PREFILL_SECONDS_PER_TOKEN = 2e-4  # until the engine has measured its own prefill


@dataclass(eq=False)
class TierContext:
    tiers: dict[str, KVTier]  # by name, nearest first (host, disk, remote); empty: a pool with nothing below it
    runner: ModelRunner
    cache: RadixCache
    keyer: BlockKeyer
    scope_digest: bytes  # the model's unsalted scope: records of another model never load (a reload changes it)
    prefill_seconds_per_token: float = DEFAULT_PREFILL_SECONDS_PER_TOKEN  # learnt from mostly-prefill steps
    block_size: int = field(init=False)
    shape: tuple[int, ...] = field(init=False)
    dtype: str = field(init=False)
    block_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.block_size = self.cache.block_size
        self.shape, self.dtype = self.runner.block_shape, self.runner.dtype_name
        self.block_bytes = math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def record(self, block: Block, payload: bytes) -> BlockRecord:
        """The record a tier stores for a cached block whose KV is `payload`."""
        parent: Optional[object] = block.parent
        return BlockRecord(
            key=block.key,
            parent_key=parent.key if isinstance(parent, Block) else None,
            scope_digest=self.scope_digest,
            token_ids=tuple(unpack_tokens(block.token_bytes)),
            dtype=self.dtype,
            shape=self.shape,
            payload=payload,
            tenant_scope=block.scope or b"",
            owner=block.owner,
        )

    def observe_step(self, scheduled, seconds: float) -> None:
        """Learn this engine's prefill cost from steps that were mostly prefill (the fetch planner's other side)."""
        num_tokens = sum(num_new for _, num_new in scheduled)
        if num_tokens >= 64 * len(scheduled):
            per_token = seconds / num_tokens
            self.prefill_seconds_per_token += 0.2 * (per_token - self.prefill_seconds_per_token)
