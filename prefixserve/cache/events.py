"""KV cache events, shaped like vLLM's (BlockStored / BlockRemoved / AllBlocksCleared).

A replica publishes them so a router can mirror what each replica holds. The
queue is bounded: a consumer that falls behind sees `num_dropped` grow and must
resync from a full snapshot instead of trusting a partial stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

DEVICE_MEDIUM = "GPU"  # vLLM's name for the first tier, whatever the device really is


@dataclass(frozen=True)
class BlockStored:
    keys: list[bytes]
    parent_key: Optional[bytes]
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE_MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    keys: list[bytes]
    medium: str = DEVICE_MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: Optional[str] = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def event_to_dict(event: KVEvent) -> dict:
    """JSON-ready form: keys as hex strings, plus the event type name."""
    body = asdict(event)
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


@dataclass
class EventQueue:
    """Bounded FIFO of KV events, drained by one consumer."""

    max_events: int = 100_000
    num_dropped: int = 0
    _events: deque = field(default_factory=deque)

    def publish(self, event: KVEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.num_dropped += 1
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
