"""Which trace a name means: a shipped Mooncake file, the generated agent trace, or a file the user gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from .agents import AgentTraceConfig, generate_agent_trace
from .mooncake import BUILT_IN_TRACES, TRACE_DIR, Trace, load_mooncake


def load_trace(
    name_or_path: str | Path, limit: Optional[int] = None, seed: int = 0, agent: Optional[AgentTraceConfig] = None
) -> Trace:
    """A built-in trace by name (`conversation`, `synthetic`: shipped Mooncake files; `agent`: generated
    from `agent`'s knobs, default ones, with `seed`), else a Mooncake JSONL file, plain or gzip. Built-in
    names win over files of that name (write ./agent for a file called agent)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit (--limit) must be at least 1, got {limit}")
    if agent is not None and name_or_path != "agent":
        raise ValueError(
            f"agent trace knobs (--agent) shape the generated agent trace; give --trace agent "
            f"(got --trace {name_or_path})"
        )
    if name_or_path == "agent":
        trace = generate_agent_trace(replace(agent or AgentTraceConfig(), seed=seed))
        return Trace(trace.requests[:limit], trace.block_size, trace.name) if limit is not None else trace
    if name_or_path in BUILT_IN_TRACES:
        trace = load_mooncake(TRACE_DIR / f"{name_or_path}.jsonl.gz", limit)
        return Trace(trace.requests, trace.block_size, name=str(name_or_path))
    return load_mooncake(name_or_path, limit)
