"""What the server, the dashboard and a Ray replica may read of an engine from their own threads (the event loop).

Each answer is safe off the engine's thread: the served version is one immutable object a reload swaps in a
single assignment; the settings read here are fixed at start-up; the key sets are copied in one C-level step
each (`list` of a dict); the KV event queue is thread-safe. Anything else goes through the engine's thread
(AsyncLLMEngine.call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..cache.events import EventQueue
from .model_version import ModelVersion

if TYPE_CHECKING:
    from .engine import LLMEngine


@dataclass(frozen=True)
class CachedKeys:
    """Every key the pool and the replica's own tiers hold, and the KV event cursor they are current to."""

    pool: list[bytes]
    tiers: dict[str, list[bytes]]  # by KV-event medium: the local tiers a router mirrors
    next_event: Optional[int]  # None: KV events are off


class EngineQueries:
    def __init__(self, engine: "LLMEngine") -> None:
        self._engine = engine

    @property
    def version(self) -> ModelVersion:
        """The served model version (weights, tokenizer, scope, max_model_len): read it once per use."""
        return self._engine.version

    @property
    def block_size(self) -> int:
        return self._engine.config.block_size

    @property
    def prefix_hash(self) -> str:
        return self._engine.config.prefix_hash

    @property
    def enable_prefix_caching(self) -> bool:
        return self._engine.config.enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return self._engine.cache.pool.num_blocks

    @property
    def has_shared_tier(self) -> bool:
        return self._engine.tiers.shared is not None

    @property
    def events(self) -> Optional[EventQueue]:
        """The KV event queue (thread-safe), None when KV events are off."""
        return self._engine.events

    def shared_prefixes(self) -> list[list[int]]:
        """The operator's declared public prefixes, as token-id lists (a copy)."""
        return [list(prefix) for prefix in list(self._engine.scoper.shared_prefixes)]

    def cached_keys(self) -> CachedKeys:
        """The cursor first, then the keys: events from the cursor on, replayed in order over keys read a little
        later, still end at the engine's state (a router that polls this never waits for a step)."""
        engine = self._engine
        cursor = engine.events.next_seq if engine.events is not None else None
        return CachedKeys(engine.cache.keys(), engine.tiers.tier_keys(), cursor)
