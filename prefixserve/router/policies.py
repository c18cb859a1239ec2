"""Routing policies: which replica serves a request. Shared by the simulator and the HTTP router.

A policy sees only `ReplicaView`s: for each replica, how many leading blocks of
this request it would hit (from a router-side mirror of its cached keys), where
it can, what tiers below its pool hold after that, and its current load in
estimated seconds of outstanding work. It never sees a simulator or an engine,
so the same object routes simulated and real traffic. Every policy is
deterministic (seeded where random). The mirror is prefix_mirror.py; the options
every policy takes, policy_options.py.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from prefixserve.cache import pack_tokens
from prefixserve.tiers.policy import plan_fetch

from .policy_options import PolicyOptions


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows about a request before placing it."""

    keys: Sequence[bytes]  # chained keys of the prompt's full blocks (cache.BlockKeyer)
    token_ids: Sequence[int]  # the prompt (a real index compares them on a hit)
    scope_digest: bytes  # parent of block 0 (cache.CacheScope.digest)
    num_blocks: int  # blocks the prompt spans, the partial tail included
    tokens_per_block: int  # 16 for an engine's keys; 512 when a trace block id stands for 512 tokens
    remote_blocks: int = 0  # leading blocks the fleet-shared remote tier holds (the HTTP router asks Redis)


class ReplicaView(Protocol):
    """A replica as a policy sees it.

    A view may also have `lower_tier_run(request) -> Sequence[tuple[str, int]]`: the
    blocks right after its device hit that tiers below the pool hold, as (tier, number
    of blocks) segments in chain order, e.g. [("host", 3), ("remote", 12)], the
    fleet-shared remote tier included. A view without it (the HTTP router's today)
    is priced as if nothing lay below its pool. And it may have `queue_seconds`: how
    long a prefill queued now would wait; without it, kv_aware takes `load` as the wait.
    """

    name: str  # stable identity (consistent hashing survives removal of other replicas)

    @property
    def load(self) -> float:
        """Estimated seconds of work the replica still owes (queued prefill + running decode)."""

    def num_hit_blocks(self, request: RouteRequest) -> int:
        """How many leading blocks of `request` the replica is predicted to have cached."""


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
    """Minimise an estimated TTFT: queue + fetch what tiers below the pool hold + recompute the rest.

    The queue is the view's `queue_seconds` where it has one, else its `load`.
    On each replica the request hits its device prefix, fetches the part of the
    lower-tier run the engine's planner would fetch (plan_fetch: a run in the
    fleet-shared remote tier is reachable from every replica), and recomputes
    what is left; recomputed tokens are weighted by `miss_token_seconds`. So an
    idle replica that can fetch a prefix wins over a busy one holding it in its
    pool once the wait exceeds the fetch.

    Recent work: prefill routed to a replica lately adds `recent_work_weight` x its
    seconds to that replica's cost, because the sessions just placed there will send
    their next turns there. It steers new sessions (whose only hit is a shared system
    prompt) apart; a session's own history outweighs it, so sessions stay put.

    Pool pressure: where the view has `kv_cache_usage` (the share of its pool running
    requests hold), a missing token costs 1 + kv_usage_weight x usage times more: a
    full pool caches a new prefix only by evicting others (or not at all).

    Balance guard: when the cheapest replica's queue exceeds the mean queue x
    threshold + slack, the cheapest replica under that limit takes the request, if
    its prefill there (unweighted) ends sooner than waiting for the over-limit one
    by more than move_cost_factor x the extra it recomputes there.
    So a hot prefix cannot pile every request onto the one replica that holds it, a
    session that must move goes where its prefix is cheapest to get back, and no
    request is moved to a replica where it would start later. The guard reads the
    queue, not `load`: decoding overlaps prefill (chunked prefill), so a replica
    busy with long answers is no slower to start the next prompt (agent traces with
    long outputs lost both hit rate and TTFT p99 to consistent hashing when the
    guard read `load`, and when it moved long sessions whatever the recompute cost).

    Ties (an idle fleet, a new prefix) go to the replica chosen least recently, so
    new prefixes spread; once placed, a prefix makes its replica cheaper: sticky.
    """

    name = "kv_aware"
    TIE_SECONDS = 1e-9  # costs this close are equal

    def __init__(self, options: PolicyOptions = PolicyOptions()) -> None:
        super().__init__(options)
        self.num_fallbacks = 0
        self._last_chosen: dict[str, int] = {}  # replica name -> choice number (tie-break)
        self._recent_work: dict[str, float] = {}  # replica name -> prefill seconds routed there lately
        self._num_choices = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        waits = [getattr(replica, "queue_seconds", None) for replica in replicas]
        waits = [replica.load if wait is None else wait for replica, wait in zip(replicas, waits)]
        recent = self._decay_recent_work(replicas)
        weight = self.options.recent_work_weight
        costs = [
            wait + self.missing_seconds(request, replica) + weight * recent[replica.name]
            for replica, wait in zip(replicas, waits)
        ]
        best = self._cheapest(replicas, costs, range(len(replicas)))
        limit = sum(waits) / len(waits) * self.options.balance_threshold + self.options.balance_slack_seconds
        if waits[best] > limit:  # the shortest wait is never above the limit, so there is a candidate
            fallback = self._cheapest(replicas, costs, [i for i, wait in enumerate(waits) if wait <= limit])
            there, here = (self.prefill_seconds(request, replicas[i]) for i in (fallback, best))
            extra = self.options.move_cost_factor * max(there - here, 0.0)
            if waits[fallback] + there + extra < waits[best] + here:
                best = fallback
                self.num_fallbacks += 1
        recent[replicas[best].name] += self.prefill_seconds(request, replicas[best])
        self._num_choices += 1
        self._last_chosen[replicas[best].name] = self._num_choices
        return best

    def _cheapest(self, replicas: Sequence[ReplicaView], costs: Sequence[float], among: Sequence[int]) -> int:
        """The cheapest of `among`; of costs within TIE_SECONDS, the replica chosen least recently (lowest index)."""
        least = min(costs[i] for i in among)
        tied = [i for i in among if costs[i] <= least + self.TIE_SECONDS]
        return min(tied, key=lambda i: self._last_chosen.get(replicas[i].name, -1))

    def _decay_recent_work(self, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        """Each replica's prefill seconds routed to it lately, decayed by 1 / (4 x replicas) a decision."""
        keep = 1.0 - 1.0 / (4 * len(replicas))
        recent = self._recent_work
        for replica in replicas:
            recent[replica.name] = recent.get(replica.name, 0.0) * keep
        return recent

    def missing_seconds(
        self, request: RouteRequest, replica: ReplicaView, token_seconds: Optional[float] = None
    ) -> float:
        """What the prompt's missing blocks cost on `replica`: fetch (from the planner) + recompute, a recomputed
        token weighted `token_seconds` (default: `miss_token_seconds`)."""
        options = self.options
        num_missing = request.num_blocks - replica.num_hit_blocks(request)
        fetch_seconds = 0.0
        lower_tier_run = getattr(replica, "lower_tier_run", None)
        if lower_tier_run is not None and options.tier_costs and options.kv_bytes_per_token:
            run = lower_tier_run(request)
            if run:
                plan = plan_fetch(
                    list(run),
                    int(options.kv_bytes_per_token * request.tokens_per_block),
                    options.prefill_seconds_per_token,
                    request.tokens_per_block,
                    options.tier_costs,
                )
                fetch_seconds = plan.fetch_seconds
                num_missing -= plan.num_fetch_blocks
        if token_seconds is None:  # the weighted price: dearer where running requests fill the pool
            usage = getattr(replica, "kv_cache_usage", None) or 0.0
            token_seconds = options.miss_token_seconds * (1.0 + options.kv_usage_weight * usage)
        return fetch_seconds + num_missing * request.tokens_per_block * token_seconds

    def prefill_seconds(self, request: RouteRequest, replica: ReplicaView) -> float:
        """The prefill `request` would take on `replica`, unweighted: fetch + recompute at prefill speed."""
        return self.missing_seconds(request, replica, self.options.prefill_seconds_per_token)


POLICIES: dict[str, Callable[[PolicyOptions], RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobin, LeastLoaded, PowerOfTwo, ConsistentHash, KVAware)
}
