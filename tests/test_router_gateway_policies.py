"""The gateways' scorers the simulator compares kv_aware with (router/gateway_policies.py): each decision as
the gateway's documented rule makes it, with exact expectations."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixserve.router.gateway_policies import LLMDDefault, VLLMRouterCacheAware
from prefixserve.router.policies import RouteRequest
from prefixserve.router.policy_registry import make_policy
from prefixserve.simulator.replay import SimulationConfig, compare_policies
from prefixserve.traces.agents import AgentTraceConfig
from prefixserve.traces.named import load_trace


@dataclass
class View:
    name: str
    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage: float = 0.0
    load: float = 0.0

    def num_hit_blocks(self, request: RouteRequest) -> int:
        return 0


def prompt(*blocks: str) -> RouteRequest:
    """A prompt of these blocks; the chained key of block i names blocks 0..i."""
    keys = ["/".join(blocks[: i + 1]).encode() for i in range(len(blocks))]
    return RouteRequest(
        keys=keys,
        token_ids=list(range(16 * len(blocks))),
        scope_digest=b"scope",
        num_blocks=len(blocks),
        tokens_per_block=16,
    )


def test_vllm_router_follows_its_tree_while_balanced_and_the_least_loaded_when_not():
    policy = VLLMRouterCacheAware()
    views = [View("a"), View("b"), View("c")]
    assert policy.choose(prompt("sys", "q1"), views) == 0  # nothing routed yet: the smallest tree, first on ties
    assert policy.choose(prompt("other", "q1", "x"), views) == 1  # no match: the smallest tree again
    assert policy.choose(prompt("sys", "q2"), views) == 0  # half the prompt matched (> 30%): its replica
    assert policy.choose(prompt("sys", "q3", "x", "y"), views) == 2  # a quarter matched (<= 30%): smallest tree
    views[2].num_requests_running = 200  # max - min = 200 > 64 and 200 > 1.5 x 0: imbalanced
    assert policy.choose(prompt("sys", "q3", "x", "y"), views) == 0  # least loaded (a tie: the first)
    views[0].num_requests_waiting, views[1].num_requests_waiting = 150, 170
    views[2].num_requests_running = 200  # max - min = 50: balanced again, back to the tree
    assert policy.choose(prompt("other", "q1", "x", "z"), views) == 1


def test_llm_d_weighs_prefix_three_queue_two_and_kv_utilisation_two():
    policy = LLMDDefault()
    views = [View("a"), View("b")]
    assert policy.choose(prompt("sys", "q1", "q2", "q3"), views) == 0  # all scores tie: the first
    # a: prefix 3 x 3/4, queue 2 x 0 (the most waiting), kv 2 x (1 - 0.5) = 3.25
    # b: prefix 0, queue 2 x 1, kv 2 x (1 - 0.1) = 3.8
    views[0].num_requests_waiting, views[0].kv_cache_usage = 4, 0.5
    views[1].num_requests_waiting, views[1].kv_cache_usage = 1, 0.1
    assert policy.choose(prompt("sys", "q1", "q2", "r"), views) == 1
    # b now holds sys/q1/q2 too; a holds sys/q1/q2/q3. Queues equal (both score 1), usage equal:
    # a: 3 x 4/5 + 2 + 2 x 0.9 = 6.2, b: 3 x 3/5 + 2 + 1.8 = 5.6
    views[0].num_requests_waiting, views[0].kv_cache_usage = 1, 0.1
    assert policy.choose(prompt("sys", "q1", "q2", "q3", "t"), views) == 0


def test_the_simulator_replays_the_gateways_scorers_by_name():
    with pytest.raises(ValueError, match="llm_d_default"):
        make_policy("llm_d")
    trace = load_trace("agent", 300, 0, AgentTraceConfig())
    config = SimulationConfig(num_replicas=4, capacity_blocks=200, progress=False)
    names = ["kv_aware", "vllm_router_cache_aware", "llm_d_default"]
    first = compare_policies(trace, names, config)
    again = compare_policies(trace, names, config)
    assert [(result.policy, result.hit_rate, result.ttft_p99) for result in first] == [
        (result.policy, result.hit_rate, result.ttft_p99) for result in again
    ]
    assert [result.policy for result in first[:3]] == names and all(result.hit_rate > 0.5 for result in first[:3])
