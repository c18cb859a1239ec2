"""Routing policies: which replica serves a request. Shared by the simulator and the HTTP router.

A policy sees only `ReplicaView`s: for each replica, how many leading blocks of
this request it would hit (from a router-side mirror of its cached keys) and
its current load in estimated seconds of outstanding work. It never sees a
simulator or an engine, so the same object routes simulated and real traffic.
Every policy is deterministic (seeded where random) and breaks ties by the
lowest replica index.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from prefixserve.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, pack_tokens


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows about a request before placing it."""

    keys: Sequence[bytes]  # chained keys of the prompt's full blocks (cache.BlockKeyer)
    token_ids: Sequence[int]  # the prompt (a real index compares them on a hit)
    scope_digest: bytes  # parent of block 0 (cache.CacheScope.digest)
    num_blocks: int  # blocks the prompt spans, the partial tail included
    tokens_per_block: int  # 16 for an engine's keys; 512 when a trace block id stands for 512 tokens


class ReplicaView(Protocol):
    name: str  # stable identity (consistent hashing survives removal of other replicas)

    @property
    def load(self) -> float:
        """Estimated seconds of work the replica still owes (queued prefill + running decode)."""

    def num_hit_blocks(self, request: RouteRequest) -> int:
        """How many leading blocks of `request` the replica is predicted to have cached."""


class PrefixMirror:
    """A router-side copy of one replica's cached keys, kept current from its KV events.

    Chained keys make a set enough: key i exists only if blocks 0..i matched, and
    a replica evicts leaves first, so the leading run of present keys is its hit.
    """

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.keys.update(event.keys)
        elif isinstance(event, BlockRemoved):
            self.keys.difference_update(event.keys)
        elif isinstance(event, AllBlocksCleared):
            self.keys.clear()

    def num_hit_blocks(self, request: RouteRequest) -> int:
        # The engine always recomputes the last prompt token, so it never hits every block.
        limit = min(len(request.keys), max(request.num_blocks - 1, 0))
        for i in range(limit):
            if request.keys[i] not in self.keys:
                return i
        return limit


@dataclass(frozen=True)
class PolicyOptions:
    seed: int = 0  # power_of_two's sampler
    hash_prefix_blocks: int = 4  # consistent_hash: the first k blocks name the ring position
    virtual_nodes: int = 64  # consistent_hash: ring points per replica
    # kv_aware: what one prompt token that misses is worth, in seconds of load. Its own prefill
    # time (6e-5 s on an H100 for an 8B model) undervalues it: the recomputed blocks duplicate KV
    # cached elsewhere, crowding this replica's cache, and the session's later turns follow it.
    # 3x the prefill time per token kept kv_aware within 1% of the infinite-cache bound on the
    # agent traces with imbalance under 1.25 (see tests/test_router_simulate.py, benchmarks/).
    miss_token_seconds: float = 1.8e-4
    balance_threshold: float = 1.5  # kv_aware: fall back when load > mean load x threshold + slack
    balance_slack_seconds: float = 0.5  # about 8k tokens of prefill

    def __post_init__(self) -> None:
        if self.hash_prefix_blocks < 1 or self.virtual_nodes < 1:
            raise ValueError("hash_prefix_blocks and virtual_nodes must be at least 1")
        if self.miss_token_seconds < 0 or self.balance_threshold < 1 or self.balance_slack_seconds < 0:
            raise ValueError("kv_aware needs miss_token_seconds >= 0, balance_threshold >= 1, balance_slack_seconds >= 0")


class RoutingPolicy:
    name = "policy"

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        self.options = options

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        """Index into `replicas` of the replica that should serve `request`."""
        raise NotImplementedError


def _argmin(values: Sequence[float]) -> int:
    """Index of the smallest value, the lowest index on ties."""
    return min(range(len(values)), key=values.__getitem__)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.num_routed = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        index = self.num_routed % len(replicas)
        self.num_routed += 1
        return index


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return _argmin([replica.load for replica in replicas])


class PowerOfTwo(RoutingPolicy):
    """Sample two distinct replicas, take the less loaded (the lower index on a tie)."""

    name = "power_of_two"

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.rng = random.Random(options.seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        if len(replicas) == 1:
            return 0
        first, second = sorted(self.rng.sample(range(len(replicas)), 2))
        return second if replicas[second].load < replicas[first].load else first


def _ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class ConsistentHash(RoutingPolicy):
    """Hash the first k blocks onto a ring of virtual nodes; load is ignored.

    The ring is built from replica names, so removing one replica moves only
    the prefixes it owned. Chained keys make key k-1 a digest of blocks 0..k-1.
    """

    name = "consistent_hash"

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self._ring_names: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _build_ring(self, names: tuple[str, ...]) -> None:
        ring = sorted(
            (_ring_point(f"{name}#{vnode}".encode()), name)
            for name in names
            for vnode in range(self.options.virtual_nodes)
        )
        self._ring_names = names
        self._points = [point for point, _ in ring]
        self._owners = [name for _, name in ring]

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        names = tuple(replica.name for replica in replicas)
        if names != self._ring_names:
            self._build_ring(names)
        num_keys = min(self.options.hash_prefix_blocks, len(request.keys))
        if num_keys:
            anchor = request.keys[num_keys - 1]
        else:  # shorter than one block: nothing to share, so spread such prompts by their tokens
            anchor = request.scope_digest + pack_tokens(request.token_ids)
        slot = bisect.bisect_left(self._points, _ring_point(anchor)) % len(self._points)
        return names.index(self._owners[slot])


class KVAware(RoutingPolicy):
    """Minimise (blocks to prefill) x seconds per block + load: a weighted estimate of the TTFT.

    Balance guard: if that replica's load exceeds mean load x threshold + slack,
    take the least-loaded replica instead, so a hot prefix cannot pile every
    request onto the one replica that holds it.
    """

    name = "kv_aware"

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.num_fallbacks = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        loads = [replica.load for replica in replicas]
        weight = self.options.miss_token_seconds * request.tokens_per_block
        costs = [
            (request.num_blocks - replica.num_hit_blocks(request)) * weight + load
            for replica, load in zip(replicas, loads)
        ]
        best = _argmin(costs)
        mean_load = sum(loads) / len(loads)
        if loads[best] > mean_load * self.options.balance_threshold + self.options.balance_slack_seconds:
            self.num_fallbacks += 1
            best = _argmin(loads)
        return best


POLICIES: dict[str, Callable[[PolicyOptions], RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoaded, PowerOfTwo, ConsistentHash, KVAware)
}


def make_policy(name: str, options: Optional[PolicyOptions] = None) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory(options or PolicyOptions())
