"""The scorers of the gateways fleets already run, reproduced for the simulator, so a user can hold kv_aware
against what vllm-router, SGLang's router and SMG (`cache_aware`) and llm-d's endpoint picker would do.

    vllm_router_cache_aware   imbalanced (max - min in-flight requests > 64 and max > 1.5 x min): the least
                              loaded; else the replica whose tree of routed prompts matches the most, if the
                              match is over 30% of the prompt; else the replica with the smallest tree.
                              (vllm-router's defaults: cache_threshold 0.3, balance_abs_threshold 64,
                              balance_rel_threshold 1.5; SMG's and SGLang's cache_aware have the same shape.)
    llm_d_default             the highest weighted sum of three scores in [0, 1]: prefix 3 x (blocks of the
                              prompt in the replica's record of routed prompts / blocks of the prompt),
                              queue 2 x (min-max normalised, fewer waiting is better), KV utilisation
                              2 x (1 - the replica's KV usage): the weights llm-d's inference-scheduling guide
                              configures.

Both keep their own record of what they routed where (an approximate index, as the gateways do: they never
see evictions), in prompt blocks here where the gateways keep characters or hashed token blocks. They read
the replica's in-flight and waiting requests and its KV usage as fresh as the simulator's state, so they are
shown at their best: a real gateway scrapes metrics every few hundred milliseconds. The simulator's replicas
provide `num_requests_running`, `num_requests_waiting` and `kv_cache_usage`; the HTTP router's views do
not, which is why `prefixserve route` does not offer these.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .policies import ReplicaView, RouteRequest, RoutingPolicy
from .policy_options import PolicyOptions


class RoutedPrefixes:
    """Per replica, the chained keys of the prompts routed there, least recently routed first (bounded)."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        self.max_blocks = max_blocks_per_replica
        self._keys: dict[str, OrderedDict[bytes, None]] = {}

    def num_matched(self, replica: str, request: RouteRequest) -> int:
        """Leading blocks of `request` this replica was routed before (chained keys: a prefix match)."""
        keys = self._keys.get(replica)
        if not keys:
            return 0
        num = 0
        for key in request.keys:
            if key not in keys:
                break
            num += 1
        return num

    def size(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))

    def record(self, replica: str, request: RouteRequest) -> None:
        keys = self._keys.setdefault(replica, OrderedDict())
        for key in request.keys:
            keys[key] = None
            keys.move_to_end(key)
        while len(keys) > self.max_blocks:
            keys.popitem(last=False)


def in_flight(replica: ReplicaView) -> int:
    return replica.num_requests_running + replica.num_requests_waiting


class VLLMRouterCacheAware(RoutingPolicy):
    name = "vllm_router_cache_aware"
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS_THRESHOLD = 64
    BALANCE_REL_THRESHOLD = 1.5
    MAX_TREE_BLOCKS = 1 << 20  # its trees hold 2^26 characters by default: about 2^20 blocks of 16 tokens

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.routed = RoutedPrefixes(self.MAX_TREE_BLOCKS)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        loads = [in_flight(replica) for replica in replicas]
        lowest, highest = min(loads), max(loads)
        if highest - lowest > self.BALANCE_ABS_THRESHOLD and highest > lowest * self.BALANCE_REL_THRESHOLD:
            best = loads.index(lowest)
        else:
            matched = [self.routed.num_matched(replica.name, request) for replica in replicas]
            best = max(range(len(replicas)), key=lambda i: (matched[i], -i))
            if not request.keys or matched[best] / len(request.keys) <= self.CACHE_THRESHOLD:
                sizes = [self.routed.size(replica.name) for replica in replicas]
                best = sizes.index(min(sizes))
        self.routed.record(replicas[best].name, request)
        return best


class LLMDDefault(RoutingPolicy):
    name = "llm_d_default"
    PREFIX_WEIGHT, QUEUE_WEIGHT, KV_UTILIZATION_WEIGHT = 3.0, 2.0, 2.0
    LRU_BLOCKS_PER_REPLICA = 31_250  # the prefix plugin's default lruCapacityPerServer

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.routed = RoutedPrefixes(self.LRU_BLOCKS_PER_REPLICA)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        num_blocks = max(len(request.keys), 1)
        waiting = [replica.num_requests_waiting for replica in replicas]
        fewest, most = min(waiting), max(waiting)
        scores = []
        for replica, num_waiting in zip(replicas, waiting):
            prefix = self.routed.num_matched(replica.name, request) / num_blocks
            queue = 1.0 if most == fewest else (most - num_waiting) / (most - fewest)
            scores.append(
                self.PREFIX_WEIGHT * prefix
                + self.QUEUE_WEIGHT * queue
                + self.KV_UTILIZATION_WEIGHT * (1.0 - replica.kv_cache_usage)
            )
        best = max(range(len(replicas)), key=lambda i: (scores[i], -i))
        self.routed.record(replicas[best].name, request)
        return best


GATEWAY_POLICIES = {policy.name: policy for policy in (VLLMRouterCacheAware, LLMDDefault)}
