"""The agent trace generator's knobs: each changes the trace as it says, and bad knobs name the fix."""

import math
import random
import statistics
from dataclasses import replace

import pytest

from prefixserve.cli import main
from prefixserve.traces.agents import (
    GAP_DISTRIBUTIONS,
    AgentTraceConfig,
    draw_gap,
    generate_agent_trace,
    parse_agent_knobs,
)
from prefixserve.traces.named import load_trace


def sessions_of(trace):
    by_session = {}
    for request in trace.requests:
        by_session.setdefault(request.session_id, []).append(request)
    return by_session


def test_the_default_shape_is_the_one_the_shipped_figures_were_measured_on():
    trace = generate_agent_trace(AgentTraceConfig(seed=0))
    assert (len(trace), trace.num_input_tokens, round(trace.duration, 3)) == (4129, 82308320, 1101.26)
    assert sum(sum(request.hash_ids) for request in trace.requests) == 843232367
    assert trace.name == "agent-seed0" and AgentTraceConfig().describe() == ""


@pytest.mark.parametrize("distribution", GAP_DISTRIBUTIONS)
def test_every_gap_distribution_has_the_mean_it_is_given(distribution):
    rng = random.Random(7)
    gaps = [draw_gap(rng, distribution, 3.0) for _ in range(20000)]
    assert min(gaps) >= 0
    # pareto's shape 1.5 has infinite variance: its sample mean converges slowly
    assert statistics.fmean(gaps) == pytest.approx(3.0, rel=0.15 if distribution == "pareto" else 0.05)
    spread = statistics.pstdev(gaps)
    assert spread == 0 if distribution == "constant" else spread > 0.5
    assert draw_gap(rng, distribution, 0.0) == 0.0


def test_gap_knobs_change_when_sessions_start_and_turns_follow():
    constant = generate_agent_trace(
        AgentTraceConfig(seed=1, num_sessions=20, session_gaps="constant", think_times="constant", session_rate=0.5)
    )
    starts = sorted(turns[0].arrival_time for turns in sessions_of(constant).values())
    assert all(later - earlier == pytest.approx(2.0) for earlier, later in zip(starts, starts[1:]))
    for turns in sessions_of(constant).values():
        assert all(b.arrival_time - a.arrival_time == pytest.approx(4.0 + 8.0) for a, b in zip(turns, turns[1:]))
    bursty = generate_agent_trace(AgentTraceConfig(seed=1, num_sessions=400, session_gaps="pareto"))
    poisson = generate_agent_trace(AgentTraceConfig(seed=1, num_sessions=400))
    gaps = {
        name: [b - a for a, b in zip(s, s[1:])]
        for name, s in (
            ("pareto", sorted(t[0].arrival_time for t in sessions_of(bursty).values())),
            ("exponential", sorted(t[0].arrival_time for t in sessions_of(poisson).values())),
        )
    }
    assert max(gaps["pareto"]) > max(gaps["exponential"])  # the heavy tail: long lulls between bursts


def test_shape_knobs_set_turns_lengths_and_system_prompt_popularity():
    config = AgentTraceConfig(
        seed=2,
        num_sessions=200,
        turns=(2, 3),
        output_tokens=(7, 7),
        tool_result_tokens=(0, 0),
        task_tokens=(10, 10),
        tool_schema_tokens=0,
        num_system_prompts=8,
        system_prompt_tokens=(1024, 1024),
        system_prompt_skew=2.0,
    )
    trace = generate_agent_trace(config)
    by_session = sessions_of(trace)
    assert {len(turns) for turns in by_session.values()} == {2, 3}
    assert {request.output_length for request in trace.requests} == {7}
    for turns in by_session.values():  # each turn adds only the previous answer (7 tokens, no tool result)
        assert [t.input_length for t in turns] == [1034 + 7 * i for i in range(len(turns))]
    first_blocks = [turns[0].hash_ids[0] for turns in by_session.values()]
    counts = sorted((first_blocks.count(block) for block in set(first_blocks)), reverse=True)
    assert counts[0] > 0.5 * len(by_session) and len(counts) > 2  # Zipf 2: the top prompt takes about 2/3
    uniform = generate_agent_trace(AgentTraceConfig(seed=2, num_sessions=200, num_system_prompts=8))
    firsts = [turns[0].hash_ids[0] for turns in sessions_of(uniform).values()]
    assert max(firsts.count(block) for block in set(firsts)) < 0.25 * 200


def test_at_load_scales_sessions_and_their_rate_over_the_same_span():
    base = AgentTraceConfig(seed=3, num_sessions=40, turns=(1, 1))
    heavy = base.at_load(2.5)
    assert (heavy.num_sessions, heavy.session_rate) == (100, pytest.approx(0.625))
    light, doubled = generate_agent_trace(base), generate_agent_trace(base.at_load(2.0))
    assert len(doubled) == 2 * len(light)
    assert doubled.duration == pytest.approx(light.duration, rel=0.5)
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="load factor must be a positive number"):
            base.at_load(bad)


def test_knobs_parse_from_text_and_round_trip_through_describe():
    config = parse_agent_knobs(
        "num_sessions=80, turns=2-6,think_times=pareto,system_prompt_skew=1.2,output_tokens=50,session_rate=0.5"
    )
    assert (config.num_sessions, config.turns, config.think_times) == (80, (2, 6), "pareto")
    assert (config.system_prompt_skew, config.output_tokens, config.session_rate) == (1.2, (50, 50), 0.5)
    assert parse_agent_knobs(config.describe()) == config
    assert parse_agent_knobs("") == AgentTraceConfig()


@pytest.mark.parametrize(
    "text, message",
    [
        ("sessions=80", "knobs num_sessions, session_rate"),
        ("seed=3", "knobs num_sessions"),  # the seed is --seed, not a knob
        ("num_sessions", "KNOB=VALUE"),
        ("num_sessions=many", "num_sessions must be an int"),
        ("turns=2-x", "turns must be a range LOW-HIGH"),
        ("turns=6-2", "turns must be a range (low, high) with 0 <= low <= high"),
        ("think_times=gaussian", "think_times must be one of exponential, constant, uniform, lognormal, pareto"),
        ("session_rate=0", "session_rate must be a positive number"),
        ("system_prompt_skew=-1", "system_prompt_skew must be a finite number >= 0"),
        ("think_time_mean_seconds=inf", "think_time_mean_seconds must be a finite number >= 0"),
    ],
)
def test_bad_knobs_name_the_fix(text, message):
    with pytest.raises(ValueError) as error:
        parse_agent_knobs(text)
    assert message in str(error.value)


def test_empty_prompts_are_no_requests():
    trace = generate_agent_trace(
        AgentTraceConfig(
            seed=4, num_sessions=5, system_prompt_tokens=(0, 0), tool_schema_tokens=0, task_tokens=(0, 0), turns=(3, 3)
        )
    )
    assert len(trace) == 10 and all(request.input_length > 0 for request in trace.requests)


def test_simulate_takes_knobs_for_the_agent_trace_only(capsys, tmp_path):
    assert (
        main(
            [
                "simulate",
                "--trace",
                "agent",
                "--agent",
                "num_sessions=6,turns=2-4,think_times=lognormal",
                "--policies",
                "kv_aware,round_robin",
                "--no-plot",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "agent-seed0 (num_sessions=6,turns=2-4,think_times=lognormal):" in out
    assert load_trace("agent", agent=parse_agent_knobs("num_sessions=6,turns=2-4,think_times=lognormal")).name in out
    assert main(["simulate", "--trace", "conversation", "--agent", "num_sessions=6", "--no-plot"]) == 2
    assert "agent trace knobs (--agent) shape the generated agent trace; give --trace agent" in capsys.readouterr().err
    assert main(["simulate", "--trace", "agent", "--agent", "turns=lots", "--no-plot"]) == 2
    assert "--agent turns must be a range LOW-HIGH (or one integer), got 'lots'" in capsys.readouterr().err
    assert (
        main(
            [
                "simulate",
                "--trace",
                "agent",
                "--agent",
                "num_sessions=10,turns=1-2",
                "--policies",
                "kv_aware",
                "--sweep",
                "load",
                "--sweep-loads",
                "0.5,1",
                "--no-plot",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "agent sessions (num_sessions=10,turns=1-2) across load, seed 0" in capsys.readouterr().out


def test_a_session_ends_where_its_next_prompt_would_not_fit_the_context():
    base = AgentTraceConfig(seed=4, num_sessions=30, turns=(20, 30), tool_result_tokens=(2000, 4000))
    unlimited, limited = generate_agent_trace(base), generate_agent_trace(replace(base, max_prompt_tokens=20000))
    assert max(r.input_length for r in unlimited.requests) > 20000 >= max(r.input_length for r in limited.requests)
    assert 0 < len(limited) < len(unlimited)
    # Every session keeps its turns up to the limit: the limit cuts sessions short, it reshapes no other session.
    kept = [r for r in unlimited.requests if r.input_length <= 20000]
    assert [(r.arrival_time, r.input_length) for r in limited.requests] == [
        (r.arrival_time, r.input_length) for r in kept
    ]
    assert parse_agent_knobs("max_prompt_tokens=32768").max_prompt_tokens == 32768
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        AgentTraceConfig(max_prompt_tokens=-1)
