"""kv_aware against every policy on agent traces of many shapes, at a light, a medium and a heavy load (issue 24).

Each family turns the generator's knobs (traces/agents.py) away from the built-in shape: session
counts and turns, system prompts (how many, how long, how skewed), gap distributions, output and
tool-result lengths. The load is set by the trace's uncached utilization (the share of the fleet's
prefill time it would take with no prefix cache), so light, medium and heavy mean the same for
every shape. Deterministic: assertions read the simulator's outputs, never wall time.
"""

import functools
import statistics
from dataclasses import replace

import pytest

from prefixserve.router.policies import POLICIES
from prefixserve.simulator.replay import SimulationConfig, compare_policies, uncached_utilization
from prefixserve.simulator.report import BOUND_NAME
from prefixserve.traces.agents import generate_agent_trace, parse_agent_knobs

FAMILIES = {
    "short_sessions": "num_sessions=36,session_rate=0.5,turns=2-6,num_system_prompts=32,"
    "system_prompt_tokens=500-1500,tool_result_tokens=50-300,task_tokens=100-400",
    "long_tool_results": "num_sessions=60,session_rate=0.1,turns=4-10,tool_result_tokens=2000-6000",
    "long_answers": "output_tokens=1000-4000,turns=4-10,num_sessions=100,session_rate=0.15",
    "hot_system_prompt": "num_sessions=80,num_system_prompts=2,system_prompt_skew=1.5,system_prompt_tokens=400-5200,"
    "tool_schema_tokens=500,task_tokens=500-2900,turns=6-23,tool_result_tokens=1900-2200,"
    "output_tokens=200-1300,think_time_mean_seconds=3,think_times=pareto,session_gaps=lognormal",
    "bursty": "session_gaps=pareto,think_times=pareto,turns=6-20,num_sessions=12",
    "chat": "num_sessions=30,session_rate=1.0,turns=1-3,tool_schema_tokens=0,num_system_prompts=16,"
    "think_time_mean_seconds=30",
    "few_long_sessions": "num_sessions=400,session_gaps=constant,system_prompt_tokens=4500-5600,system_prompt_skew=0.8,"
    "tool_schema_tokens=500,turns=24-31,tool_result_tokens=2200-3800,output_tokens=2400-2800,"
    "turn_gap_seconds=0.5,think_time_mean_seconds=0.5",
    "steady_tight_turns": "session_gaps=constant,think_times=uniform,num_sessions=400,turns=12-30,"
    "turn_gap_seconds=0.5,think_time_mean_seconds=1,tool_result_tokens=3800-4900,"
    "output_tokens=300-1400,num_system_prompts=16",
}
LOADS = {"light": 0.1, "medium": 0.3, "heavy": 0.6}  # uncached utilization
SEEDS = (0, 1)
HIT_RATE_POINTS = 0.005  # kv_aware's hit rate may trail the best other policy's by half a point
TTFT_P99_RATIO = 1.05  # and its TTFT p99 the best other's by 5%
CONFIG = SimulationConfig(num_replicas=8)


@functools.lru_cache(maxsize=None)
def trace_at(family, load, seed):
    """The family's trace with as many sessions as give the load's utilization (to a few percent); built
    once per module (the fixture and the shape test read the same traces, and the simulator never changes one)."""
    base = replace(parse_agent_knobs(FAMILIES[family]), seed=seed)
    factor, trace = 1.0, generate_agent_trace(base)
    for _ in range(4):  # the span of a trace is not quite proportional to its sessions (gaps, think times)
        factor *= LOADS[load] / uncached_utilization(trace, CONFIG)
        trace = generate_agent_trace(base.at_load(factor))
    return trace


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_results(request):
    """load -> policy -> (mean hit rate, mean TTFT p99) over the seeds."""
    by_load = {}
    for load in LOADS:
        runs = [compare_policies(trace_at(request.param, load, seed), list(POLICIES), CONFIG) for seed in SEEDS]
        by_load[load] = {
            row.policy: (
                statistics.fmean(run[i].hit_rate for run in runs),
                statistics.fmean(run[i].ttft_p99 for run in runs),
            )
            for i, row in enumerate(runs[0])
        }
    return request.param, by_load


def test_kv_aware_is_within_half_a_point_and_five_percent_of_the_best_policy_at_every_load(family_results):
    """A family's figures are means over two seeds: one trace's p99 rests on its few dozen slowest requests,
    and where they land moves it by about 5% (short_sessions at medium load: kv_aware over consistent
    hashing 1.07 on seed 0, 0.95-0.97 on seeds 1 to 4)."""
    family, by_load = family_results
    for load, results in by_load.items():
        kv_hit, kv_p99 = results["kv_aware"]
        others = {name: value for name, value in results.items() if name not in ("kv_aware", BOUND_NAME)}
        assert len(others) == len(POLICIES) - 1
        best_hit = max(others, key=lambda name: others[name][0])
        best_p99 = min(others, key=lambda name: others[name][1])
        assert kv_hit >= others[best_hit][0] - HIT_RATE_POINTS, (
            f"{family} at {load} load: kv_aware hits {kv_hit:.2%}, {best_hit} {others[best_hit][0]:.2%}"
        )
        assert kv_p99 <= others[best_p99][1] * TTFT_P99_RATIO, (
            f"{family} at {load} load: kv_aware TTFT p99 {kv_p99:.3f} s, {best_p99} {others[best_p99][1]:.3f} s"
        )
        assert kv_hit <= results[BOUND_NAME][0]


def test_the_loads_differ_and_the_families_differ_from_each_other():
    for family in FAMILIES:
        traces = [trace_at(family, load, 0) for load in LOADS]
        utilizations = [uncached_utilization(trace, CONFIG) for trace in traces]
        assert utilizations == pytest.approx(list(LOADS.values()), rel=0.15)
        assert 100 <= len(traces[0]) < len(traces[1]) < len(traces[2]) <= 7000
    shapes = {(len(trace), trace.num_input_tokens) for trace in (trace_at(f, "medium", 0) for f in FAMILIES)}
    assert len(shapes) == len(FAMILIES)
