"""Request traces in block-id form: the Mooncake JSONL format and a seeded agent-session generator.

Built in: `conversation` and `synthetic`, the Mooncake project's two public traces (shipped gzip-
compressed as package data, prefixserve/data/traces/), and `agent`, generated here from a seed.

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
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Optional, TextIO

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


BUILT_IN_TRACES = ("conversation", "synthetic", "agent")  # `--trace NAME`; anything else is a path
TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"  # package data: <name>.jsonl.gz
_GZIP_MAGIC = b"\x1f\x8b"


def load_trace(name_or_path: str | Path, limit: Optional[int] = None, seed: int = 0) -> Trace:
    """A built-in trace by name (`conversation`, `synthetic`: shipped Mooncake files; `agent`: generated
    from `seed`), else a Mooncake JSONL file, plain or gzip. Built-in names win over files of that name
    (write ./agent for a file called agent)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit (--limit) must be at least 1, got {limit}")
    if name_or_path == "agent":
        trace = generate_agent_trace(AgentTraceConfig(seed=seed))
        return Trace(trace.requests[:limit], trace.block_size, trace.name) if limit is not None else trace
    if name_or_path in BUILT_IN_TRACES:
        trace = load_mooncake(TRACE_DIR / f"{name_or_path}.jsonl.gz", limit)
        return Trace(trace.requests, trace.block_size, name=str(name_or_path))
    return load_mooncake(name_or_path, limit)


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
        row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"])
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


# --------------------------------------------------------------------------- agent sessions
@dataclass(frozen=True)
class AgentTraceConfig:
    """Agent sessions: a shared system prompt + tool schema, then a transcript that grows every turn.

    Turn t resends the whole history (system, tools, task, every earlier answer
    and tool result) plus the newest tool result. Sessions start as a Poisson
    process; turns of one session are separated by the answer's generation plus
    tool and think time (open loop: arrivals do not wait for the simulator).
    Token ranges are inclusive (low, high), drawn uniformly.
    """

    seed: int = 0
    num_sessions: int = 160
    session_rate: float = 0.25  # sessions started per second
    block_size: int = MOONCAKE_BLOCK_SIZE
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (1500, 3000)
    tool_schema_tokens: int = 2500  # identical text for every session, after its system prompt
    task_tokens: tuple[int, int] = (200, 1200)
    turns: tuple[int, int] = (12, 40)
    tool_result_tokens: tuple[int, int] = (200, 1500)
    output_tokens: tuple[int, int] = (40, 400)
    turn_gap_seconds: float = 4.0  # at least this between turns (the answer must be generated)
    think_time_mean_seconds: float = 8.0  # plus an exponential tool / think time

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_sessions < 0 or self.num_system_prompts < 1:
            raise ValueError("AgentTraceConfig needs block_size >= 1, num_sessions >= 0, num_system_prompts >= 1")
        if self.session_rate <= 0:
            raise ValueError(f"session_rate must be positive, got {self.session_rate}")
        for name in ("system_prompt_tokens", "task_tokens", "turns", "tool_result_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 0 <= low <= high, got {(low, high)}")


@dataclass
class _Transcript:
    """Token content as (segment, length) runs; block ids come from a shared interning table."""

    segments: list[tuple[Hashable, int]] = field(default_factory=list)
    num_tokens: int = 0

    def append(self, segment: Hashable, length: int) -> None:
        if length:
            self.segments.append((segment, length))
            self.num_tokens += length

    def block_ids(self, block_size: int, interned: dict) -> list[int]:
        """Id i names (id i-1, the exact runs inside block i): equal ids <=> equal prefixes."""
        ids: list[int] = []
        pieces: list[tuple[Hashable, int, int]] = []
        filled = 0
        for segment, length in self.segments:
            offset = 0
            while offset < length:
                take = min(length - offset, block_size - filled)
                pieces.append((segment, offset, offset + take))
                offset += take
                filled += take
                if filled == block_size:
                    ids.append(interned.setdefault((ids[-1] if ids else -1, tuple(pieces)), len(interned)))
                    pieces, filled = [], 0
        if pieces:  # the partial tail block has its own id, as in the Mooncake traces
            ids.append(interned.setdefault((ids[-1] if ids else -1, tuple(pieces)), len(interned)))
        return ids


def generate_agent_trace(config: AgentTraceConfig = AgentTraceConfig()) -> Trace:
    """A deterministic agent workload for `config.seed`, in the same block-id form as Mooncake traces."""
    rng = random.Random(config.seed)
    interned: dict = {}
    system_lengths = [rng.randint(*config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    requests: list[TraceRequest] = []
    session_start = 0.0
    for session in range(config.num_sessions):
        session_start += rng.expovariate(config.session_rate)
        prompt = rng.randrange(config.num_system_prompts)
        transcript = _Transcript()
        transcript.append(("system", prompt), system_lengths[prompt])
        transcript.append("tools", config.tool_schema_tokens)
        transcript.append(("task", session), rng.randint(*config.task_tokens))
        arrival = session_start
        for turn in range(rng.randint(*config.turns)):
            output_length = rng.randint(*config.output_tokens)
            requests.append(TraceRequest(
                arrival, transcript.num_tokens, output_length,
                transcript.block_ids(config.block_size, interned), session))
            transcript.append(("answer", session, turn), output_length)
            transcript.append(("tool_result", session, turn), rng.randint(*config.tool_result_tokens))
            arrival += config.turn_gap_seconds + rng.expovariate(1.0 / config.think_time_mean_seconds)
    if len(interned) > _MAX_BLOCK_ID:
        raise ValueError("agent trace has more distinct blocks than fit in uint32 ids; generate fewer sessions")
    requests.sort(key=lambda request: request.arrival_time)
    return Trace(requests, config.block_size, name=f"agent-seed{config.seed}")
