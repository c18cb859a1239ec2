"""Request traces in block-id form: the Mooncake JSONL format, the built-in traces by name, their keys.

Built in: `conversation` and `synthetic`, the Mooncake project's two public traces (shipped gzip-
compressed as package data, prefixserve/data/traces/), and `agent`, generated from a seed and knobs
(agents.py).

Both sources yield the same shape, so the simulator treats them alike:

    prompt tokens  [0 ........ 512)[512 ..... 1024)[1024 .. 1300)
    hash_ids        7               8               9   <- the last block may be partial

A block id stands for the whole prefix up to and including its block: two
requests share their first k blocks exactly when their first k ids agree.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, TextIO

from ..cache import BlockKeyer, CacheScope

MOONCAKE_BLOCK_SIZE = 512
_MAX_BLOCK_ID = 2**32 - 1  # block ids travel as uint32 "tokens" through the cache core


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


@dataclass(slots=True)
class TraceRequest:
    arrival_time: float  # seconds from the start of the trace
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: list[int]  # one id per prompt block, prefix-chained
    session_id: Optional[int] = None


@dataclass
class Trace:
    requests: list[TraceRequest]
    block_size: int  # tokens one block id stands for
    name: str = "trace"

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0

    @property
    def num_input_tokens(self) -> int:
        return sum(request.input_length for request in self.requests)

    def at_rate(self, rate: float) -> "Trace":
        """The same requests arriving `rate` times as fast (2: twice the load on the same fleet)."""
        if not rate > 0:
            raise ValueError(f"an arrival rate factor (--rate) must be positive, got {rate}")
        if rate == 1:
            return self
        requests = [replace(request, arrival_time=request.arrival_time / rate) for request in self.requests]
        return Trace(requests, self.block_size, f"{self.name} x{rate:g}")


BUILT_IN_TRACES = ("conversation", "synthetic", "agent")  # `--trace NAME`; anything else is a path
TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"  # package data: <name>.jsonl.gz
_GZIP_MAGIC = b"\x1f\x8b"


TRACE_SCOPE = CacheScope("trace-replay", "trace-block-ids")  # the one scope every replay keys trace blocks under


def block_keys(trace: Trace) -> list[list[bytes]]:
    """Each request's chained keys of its full blocks, one trace block id a "token" (BlockKeyer(1)): what the
    simulator and the capacity planner match, so both see the same hits."""
    keyer, scope, size = BlockKeyer(1), TRACE_SCOPE.digest, trace.block_size
    return [keyer.keys(scope, request.hash_ids[: request.input_length // size]) for request in trace.requests]


def load_mooncake(path: str | Path, limit: Optional[int] = None, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Read a Mooncake trace (.jsonl, or gzip-compressed): one JSON object a line with timestamp (ms),
    lengths and hash_ids. A file without a single request is an error, not an empty replay."""
    path = Path(path)
    hint = f"pass a Mooncake trace (.jsonl or .jsonl.gz) or a built-in trace name: {', '.join(BUILT_IN_TRACES)}"
    if path.is_dir():
        raise IsADirectoryError(f"trace {path} is a directory, not a file; {hint}")
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist; {hint}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit (--limit) must be at least 1, got {limit}")
    requests: list[TraceRequest] = []
    line_number = 0
    try:
        with _open_text(path) as lines:
            for line_number, line in enumerate(lines, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse_mooncake_line(line, f"{path}:{line_number}", block_size))
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path}:{line_number + 1}: not UTF-8 text; {hint}") from None
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError; a cut-off gzip is an EOFError
        raise TraceFormatError(f"{path}: not a readable gzip file ({error}); {hint}") from None
    if not requests:
        raise TraceFormatError(f"{path}: no requests in this trace (the file is empty or blank); {hint}")
    requests.sort(key=lambda request: request.arrival_time)  # stable: file order breaks ties
    return Trace(requests, block_size, name=path.name.removesuffix(".gz").removesuffix(".jsonl"))


def _open_text(path: Path) -> TextIO:
    """The file as text lines, decompressed when it starts with the gzip magic bytes (whatever its name)."""
    with path.open("rb") as head:
        compressed = head.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rt", encoding="utf-8") if compressed else path.open(encoding="utf-8")


def _parse_mooncake_line(line: str, where: str, block_size: int) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceFormatError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(row, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [name for name in ("timestamp", "input_length", "output_length", "hash_ids") if name not in row]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp, input_length, output_length, hash_ids = (
        row["timestamp"],
        row["input_length"],
        row["output_length"],
        row["hash_ids"],
    )
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or timestamp < 0:
        raise TraceFormatError(f"{where}: timestamp must be a non-negative number of milliseconds, got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TraceFormatError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    if not isinstance(hash_ids, list) or not all(
        isinstance(block_id, int) and not isinstance(block_id, bool) and 0 <= block_id <= _MAX_BLOCK_ID
        for block_id in hash_ids
    ):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers in [0, 2**32)")
    if len(hash_ids) != math.ceil(input_length / block_size):
        raise TraceFormatError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected "
            f"ceil({input_length}/{block_size}) = {math.ceil(input_length / block_size)} (wrong block size?)"
        )
    return TraceRequest(timestamp / 1000.0, input_length, output_length, hash_ids)
