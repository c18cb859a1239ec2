"""Agent-session traces generated from a seed and knobs, in the block-id form of Mooncake traces (traces.py).

A session: one of the shared system prompts, the tool schema every session shares, its own task, then
turns that each resend the whole history plus the newest tool result:

    turn 0   [system p][tools][task s]
    turn 1   [system p][tools][task s][answer 0][tool result 0]
    turn 2   [system p][tools][task s][answer 0][tool result 0][answer 1][tool result 1]

Knobs (AgentTraceConfig fields, all settable from the command line as `--agent KNOB=VALUE,...`): how
many sessions start and how fast (load), turns per session, how many system prompts and how long,
how skewed their popularity (Zipf), task, tool-result and output lengths, the distribution of the
gaps between session starts and of the think time between turns (exponential, constant, uniform,
lognormal or Pareto with the same mean), and the model's context (a session ends when its next
prompt would not fit). Open loop: arrivals do not wait for the simulator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace
from typing import Hashable

from .mooncake import _MAX_BLOCK_ID, MOONCAKE_BLOCK_SIZE, Trace, TraceRequest

# Each has the given mean; they differ in the tail. lognormal: sigma 1 (CV 1.3); pareto: shape 1.5 (infinite variance).
GAP_DISTRIBUTIONS = ("exponential", "constant", "uniform", "lognormal", "pareto")
_LOGNORMAL_SIGMA = 1.0
_PARETO_SHAPE = 1.5


def draw_gap(rng: random.Random, distribution: str, mean: float) -> float:
    """One gap of `distribution` with `mean` seconds (0 for a mean of 0)."""
    if mean == 0:
        return 0.0
    if distribution == "exponential":
        return rng.expovariate(1.0 / mean)
    if distribution == "constant":
        return mean
    if distribution == "uniform":
        return rng.uniform(0.0, 2.0 * mean)
    if distribution == "lognormal":
        return rng.lognormvariate(math.log(mean) - _LOGNORMAL_SIGMA**2 / 2, _LOGNORMAL_SIGMA)
    if distribution == "pareto":  # paretovariate(a) has minimum 1 and mean a / (a - 1)
        return mean * (_PARETO_SHAPE - 1) / _PARETO_SHAPE * rng.paretovariate(_PARETO_SHAPE)
    raise ValueError(f"unknown gap distribution {distribution!r}; choose one of {', '.join(GAP_DISTRIBUTIONS)}")


_RANGES = ("system_prompt_tokens", "task_tokens", "turns", "tool_result_tokens", "output_tokens")


@dataclass(frozen=True)
class AgentTraceConfig:
    """The knobs of an agent workload. Token ranges are inclusive (low, high), drawn uniformly."""

    seed: int = 0
    num_sessions: int = 160
    session_rate: float = 0.25  # sessions started per second, on average
    session_gaps: str = "exponential"  # distribution of the gaps between session starts (Poisson starts)
    block_size: int = MOONCAKE_BLOCK_SIZE
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (1500, 3000)
    system_prompt_skew: float = 0.0  # Zipf exponent of which system prompt a session uses; 0: all alike
    tool_schema_tokens: int = 2500  # identical text for every session, after its system prompt
    task_tokens: tuple[int, int] = (200, 1200)
    turns: tuple[int, int] = (12, 40)
    tool_result_tokens: tuple[int, int] = (200, 1500)
    output_tokens: tuple[int, int] = (40, 400)
    turn_gap_seconds: float = 4.0  # at least this between turns (the answer must be generated)
    think_time_mean_seconds: float = 8.0  # plus a tool / think time of this mean
    think_times: str = "exponential"  # its distribution
    # A model's context: a session ends when its next prompt would be longer (agents stop or start afresh
    # there); 0: no limit (prompts grow with every turn however long the session).
    max_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_sessions < 0 or self.num_system_prompts < 1:
            raise ValueError("agent trace needs block_size >= 1, num_sessions >= 0, num_system_prompts >= 1")
        if not self.session_rate > 0 or not math.isfinite(self.session_rate):
            raise ValueError(f"session_rate must be a positive number, got {self.session_rate}")
        for name in (
            "system_prompt_skew",
            "tool_schema_tokens",
            "turn_gap_seconds",
            "think_time_mean_seconds",
            "max_prompt_tokens",
        ):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in _RANGES:
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 0 <= low <= high, got {(low, high)}")
        for name in ("session_gaps", "think_times"):
            if getattr(self, name) not in GAP_DISTRIBUTIONS:
                raise ValueError(f"{name} must be one of {', '.join(GAP_DISTRIBUTIONS)}, got {getattr(self, name)!r}")

    def at_load(self, load: float) -> "AgentTraceConfig":
        """`load` x the traffic: `load` x the sessions, started `load` x as fast (the same span of time)."""
        if not load > 0 or not math.isfinite(load):
            raise ValueError(f"a load factor must be a positive number, got {load}")
        return replace(
            self, num_sessions=max(1, round(self.num_sessions * load)), session_rate=self.session_rate * load
        )

    def describe(self) -> str:
        """The knobs that differ from the defaults, as `--agent` takes them ('' for the default workload)."""
        default = AgentTraceConfig()
        changed = [
            item.name
            for item in fields(self)
            if item.name != "seed" and getattr(self, item.name) != getattr(default, item.name)
        ]
        return ",".join(f"{name}={_format_knob(getattr(self, name))}" for name in changed)


def _format_knob(value: object) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, tuple) else str(value)


def parse_agent_knobs(text: str, base: AgentTraceConfig = AgentTraceConfig()) -> AgentTraceConfig:
    """`num_sessions=80,turns=2-6,think_times=pareto` -> `base` with those knobs (the `--agent` flag)."""
    types = {item.name: item.type for item in fields(AgentTraceConfig) if item.name != "seed"}
    changes: dict[str, object] = {}
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        name, equals, value = (piece.strip() for piece in part.partition("="))
        if not equals or name not in types:
            raise ValueError(f"--agent takes KNOB=VALUE,... with knobs {', '.join(types)}; got {part!r}")
        kind = types[name]
        try:
            if name in _RANGES:
                low, dash, high = value.partition("-")
                changes[name] = (int(low), int(high)) if dash else (int(low), int(low))
            elif kind == "int":
                changes[name] = int(value)
            elif kind == "float":
                changes[name] = float(value)
            else:
                changes[name] = value
        except ValueError:
            article = "an" if kind == "int" else "a"
            expected = "a range LOW-HIGH (or one integer)" if name in _RANGES else f"{article} {kind}"
            raise ValueError(f"--agent {name} must be {expected}, got {value!r}") from None
    return replace(base, **changes)


class _Transcript:
    """Token content as (segment, offset, end) pieces cut into blocks as it grows; block ids come from a
    shared interning table. A turn's request only cuts and interns what was appended since the last one
    (recomputing every block each turn made a long session's trace quadratic in its turns)."""

    def __init__(self, block_size: int, interned: dict) -> None:
        self.block_size = block_size
        self.interned = interned
        self.num_tokens = 0
        self.full_blocks: list[tuple] = []  # each full block's pieces, in order
        self.ids: list[int] = []  # the interned ids of full_blocks[:len(ids)]
        self.pieces: list[tuple[Hashable, int, int]] = []  # the partial tail block
        self.filled = 0

    def append(self, segment: Hashable, length: int) -> None:
        self.num_tokens += length
        offset = 0
        while offset < length:
            take = min(length - offset, self.block_size - self.filled)
            self.pieces.append((segment, offset, offset + take))
            offset += take
            self.filled += take
            if self.filled == self.block_size:
                self.full_blocks.append(tuple(self.pieces))
                self.pieces, self.filled = [], 0

    def _intern(self, previous: int, pieces: tuple) -> int:
        return self.interned.setdefault((previous, pieces), len(self.interned))

    def block_ids(self) -> list[int]:
        """Id i names (id i-1, the exact runs inside block i): equal ids <=> equal prefixes. Ids are
        interned in block order when a request first reads them, so a trace's ids do not depend on
        what its sessions append after their last request."""
        for pieces in self.full_blocks[len(self.ids) :]:
            self.ids.append(self._intern(self.ids[-1] if self.ids else -1, pieces))
        if not self.pieces:
            return list(self.ids)
        # the partial tail block has its own id, as in the Mooncake traces
        return self.ids + [self._intern(self.ids[-1] if self.ids else -1, tuple(self.pieces))]


def _choose_system_prompt(rng: random.Random, config: AgentTraceConfig, weights: list[float]) -> int:
    if not config.system_prompt_skew:
        return rng.randrange(config.num_system_prompts)
    return rng.choices(range(config.num_system_prompts), cum_weights=weights)[0]


def generate_agent_trace(config: AgentTraceConfig = AgentTraceConfig()) -> Trace:
    """A deterministic agent workload for `config` (its seed and knobs)."""
    rng = random.Random(config.seed)
    interned: dict = {}
    system_lengths = [rng.randint(*config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    popularity = [1.0 / (rank + 1) ** config.system_prompt_skew for rank in range(config.num_system_prompts)]
    cumulative = [sum(popularity[: rank + 1]) for rank in range(len(popularity))]
    requests: list[TraceRequest] = []
    session_start = 0.0
    for session in range(config.num_sessions):
        session_start += draw_gap(rng, config.session_gaps, 1.0 / config.session_rate)
        prompt = _choose_system_prompt(rng, config, cumulative)
        transcript = _Transcript(config.block_size, interned)
        transcript.append(("system", prompt), system_lengths[prompt])
        transcript.append("tools", config.tool_schema_tokens)
        transcript.append(("task", session), rng.randint(*config.task_tokens))
        arrival = session_start
        for turn in range(rng.randint(*config.turns)):
            output_length = rng.randint(*config.output_tokens)
            # Past the context the session has ended; its draws go on, so other sessions stay as they were.
            fits = not config.max_prompt_tokens or transcript.num_tokens <= config.max_prompt_tokens
            if transcript.num_tokens and fits:  # an empty prompt is no request
                requests.append(
                    TraceRequest(arrival, transcript.num_tokens, output_length, transcript.block_ids(), session)
                )
            transcript.append(("answer", session, turn), output_length)
            transcript.append(("tool_result", session, turn), rng.randint(*config.tool_result_tokens))
            arrival += config.turn_gap_seconds + draw_gap(rng, config.think_times, config.think_time_mean_seconds)
    if len(interned) > _MAX_BLOCK_ID:
        raise ValueError("agent trace has more distinct blocks than fit in uint32 ids; generate fewer sessions")
    requests.sort(key=lambda request: request.arrival_time)
    name = f"agent-seed{config.seed}" + (f" ({config.describe()})" if config.describe() else "")
    return Trace(requests, config.block_size, name=name)
