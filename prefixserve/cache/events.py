"""KV cache events, shaped like vLLM's (BlockStored / BlockRemoved / AllBlocksCleared).

A replica publishes them so a router can mirror what each replica holds. The
queue is bounded: a consumer that falls behind sees `num_dropped` grow and must
resync from a full snapshot instead of trusting a partial stream.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional, Union

DEVICE_MEDIUM = "GPU"  # vLLM's name for the first tier, whatever the device really is


@dataclass(frozen=True)
class BlockStored:
    keys: list[bytes]
    parent_key: Optional[bytes]
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE_MEDIUM
    # The scope digest the block's chain hangs from (model, or tenant past a shared prefix): the vLLM-format
    # publisher folds a digest of it into extra_keys. Not in the JSON form (/v1/kv_events never carried it).
    scope: Optional[bytes] = None
    # The LoRA adapter whose K/V it holds (vLLM's lora_id and lora_name), None for the base model's.
    lora_id: Optional[int] = None
    lora_name: Optional[str] = None


@dataclass(frozen=True)
class BlockRemoved:
    keys: list[bytes]
    medium: str = DEVICE_MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: Optional[str] = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def event_to_dict(event: KVEvent) -> dict:
    """JSON-ready form: keys as hex strings, plus the event type name (a block's scope left out)."""
    body = asdict(event)
    body.pop("scope", None)
    for name in ("lora_id", "lora_name"):  # the base model's blocks read as they always have
        if body.get(name, 0) is None:
            del body[name]
    for name in ("keys",):
        if name in body:
            body[name] = [key.hex() for key in body[name]]
    if body.get("parent_key") is not None:
        body["parent_key"] = body["parent_key"].hex()
    body["type"] = type(event).__name__
    return body


def event_from_dict(body: dict) -> KVEvent:
    body = dict(body)
    kind = body.pop("type")
    if "keys" in body:
        body["keys"] = [bytes.fromhex(key) for key in body["keys"]]
    if body.get("parent_key") is not None:
        body["parent_key"] = bytes.fromhex(body["parent_key"])
    classes = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    if kind not in classes:
        raise ValueError(f"unknown KV event type {kind!r}")
    return classes[kind](**body)


class EventQueue:
    """Bounded log of KV events with sequence numbers.

    One consumer may `drain()`; any number may read `since(cursor)` without
    consuming (a router polls each replica this way). Thread-safe: the engine
    thread publishes while a server thread reads.
    """

    def __init__(self, max_events: int = 20_000) -> None:
        self.max_events = max_events
        self.num_dropped = 0
        self.next_seq = 0  # sequence number the next event will get
        self._events: deque[tuple[int, KVEvent]] = deque()
        self._lock = threading.Lock()

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                self._events.popleft()
                self.num_dropped += 1
            self._events.append((self.next_seq, event))
            self.next_seq += 1

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events = [event for _, event in self._events]
            self._events.clear()
            return events

    def since(self, cursor: int) -> tuple[list[KVEvent], int, bool]:
        """(events numbered >= cursor, the next cursor, complete); not complete means events
        the reader never saw were already dropped, so it must resync from a snapshot."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self.next_seq
            complete = oldest <= cursor <= self.next_seq
            events = [event for seq, event in self._events if seq >= cursor]
            return events, self.next_seq, complete

    def __len__(self) -> int:
        return len(self._events)
