"""Server-sent events in and out: split a byte stream into `data:` payloads, and write one."""

from __future__ import annotations

import json
from typing import Optional

from ..http import error_body

DONE = b"data: [DONE]\n\n"


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def sse_error(message: str, code: str, type_: str = "server_error") -> bytes:
    """The OpenAI-style error event a stream ends with (followed by DONE) when it cannot go on."""
    return sse(error_body(message, type_, None, code))


class SSEParser:
    """Feed bytes as they arrive; get back each complete event's data (several `data:` lines joined by newlines)."""

    def __init__(self, max_event_bytes: int = 64 << 20) -> None:
        self.buffer = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[str]:
        self.buffer = (self.buffer + data).replace(b"\r\n", b"\n")  # a CRLF may be split across reads
        events = []
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                break
            raw, self.buffer = self.buffer[:end], self.buffer[end + 2 :]
            payload = _data_of(raw)
            if payload is not None:
                events.append(payload)
        if len(self.buffer) > self.max_event_bytes:
            raise ValueError(f"an upstream event exceeds {self.max_event_bytes} bytes")
        return events


def _data_of(raw: bytes) -> Optional[str]:
    lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None
