"""Stored responses (`store: true`, the default): a tenant's own, bounded in count and time, and the exact token
prefix a `previous_response_id` continues from.

    id -> the response object, its input items, the conversation so far (chat messages, instructions left out),
          and the tokens the turn computed: its prompt's text and ids, and its output's ids

Another tenant's id answers as a missing one (404), never with its content. Past `max_stored` the least recently
used response goes; past `ttl` seconds after its last use a response is gone. The store is this replica's own
(in memory): `prefixserve route` sends a request naming a response to the replica that answered it
(router/response_affinity.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from ..http import APIError

DEFAULT_MAX_STORED = 10_000
DEFAULT_TTL = 3600.0


@dataclass
class StoredResponse:
    tenant: Optional[str]
    body: dict  # the response object as GET returns it
    input_items: list[dict]  # this turn's input, as items (GET .../input_items)
    messages: list[dict]  # the conversation through this turn's output, without instructions
    prompt_text: str  # what the chat template rendered for this turn's prompt
    prompt_ids: list[int]
    output_ids: list[int]
    tokenizer: str  # its fingerprint: the ids continue only under the same tokenizer (a reload may change it)
    used: float = field(default_factory=time.monotonic)


class ResponseStore:
    def __init__(self, max_stored: int = DEFAULT_MAX_STORED, ttl: float = DEFAULT_TTL) -> None:
        self.max_stored, self.ttl = max_stored, ttl
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._expire(time.monotonic())
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_stored:
                self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: Optional[str], param: str = "response_id") -> StoredResponse:
        """The tenant's stored response, or a 404 naming `param` (another tenant's reads as missing)."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                raise APIError(
                    404,
                    f"{param}: no stored response {response_id!r} (responses are kept {self.ttl:g} s after their "
                    f"last use, at most {self.max_stored}, and only with store: true)",
                    "not_found_error",
                    param=param,
                    code="response_not_found",
                )
            entry.used = now
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, tenant: Optional[str]) -> None:
        self.get(response_id, tenant)
        with self._lock:
            self._entries.pop(response_id, None)

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if now - oldest.used <= self.ttl:
                return
            del self._entries[oldest_id]
