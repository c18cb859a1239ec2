"""Request traces in block-id form: Mooncake JSONL files (mooncake.py), generated agent sessions (agents.py), and
which of them a name means (named.py).

Below plan/, router/ and server/, which all read them (the capacity planner, the simulator, the
dashboard's what-if panel); imports only cache/ (the keys a trace's blocks chain to).
"""

from .agents import AgentTraceConfig, generate_agent_trace, parse_agent_knobs
from .mooncake import (
    BUILT_IN_TRACES,
    TRACE_SCOPE,
    Trace,
    TraceFormatError,
    TraceRequest,
    block_keys,
    load_mooncake,
)
from .named import load_trace

__all__ = [
    "AgentTraceConfig",
    "BUILT_IN_TRACES",
    "TRACE_SCOPE",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "block_keys",
    "generate_agent_trace",
    "load_mooncake",
    "load_trace",
    "parse_agent_knobs",
]
