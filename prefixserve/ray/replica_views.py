"""What the Ray request router knows of each engine replica, as our routing policies read a replica.

Each engine replica reports, through Ray Serve's routing stats (`record_routing_stats`, polled by
Serve's controller every `routing_stats_period_s` and broadcast to every router), the keys its
device pool and its own lower tiers hold, the share of its pool running requests hold, as 8-byte prefixes of
our block keys (prefixes are
enough to predict a hit; the engine compares the full key and the tokens before it reuses a
block), and its queue. Between two reports a router counts the keys of the requests it has just
routed to a replica as held there (as the HTTP router does until the replica's events say so),
and its own in-flight requests as that replica's load, in estimated seconds (costs.CostModel).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..cache import max_hit_blocks
from ..router.costs import CostModel
from ..router.policies import RouteRequest

KEY_PREFIX_BYTES = 8
MAX_REPORTED_KEYS = 1 << 17  # per medium, per report: 1 MiB of prefixes
EXPECTED_KEY_SECONDS = 30.0  # keys routed this recently count as held whatever the last report said
LOWER_TIERS = (("CPU", "host"), ("DISK", "disk"))  # KV-event media of a replica's own tiers, in fetch order


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Keys as the routing stats carry them: their prefixes, concatenated (the most recent MAX_REPORTED_KEYS)."""
    return b"".join(key[:KEY_PREFIX_BYTES] for key in keys[-MAX_REPORTED_KEYS:])


def unpack_keys(blob: object) -> frozenset:
    if not isinstance(blob, (bytes, bytearray)) or len(blob) % KEY_PREFIX_BYTES:
        return frozenset()  # not a report of ours (or none yet): nothing predicted held
    size = KEY_PREFIX_BYTES
    return frozenset(bytes(blob[i : i + size]) for i in range(0, len(blob), size))


@dataclass(frozen=True)
class RouteEstimate:
    """What the ingress works out about a request for the router: its keys and size (None keys: route by load)."""

    route: Optional[RouteRequest]
    max_tokens: int  # the client's limit or the replicas' default: decode work for the load estimate


class ReplicaCacheView:
    """One engine replica as a policy sees it (policies.ReplicaView): name, load, hits, lower-tier runs."""

    def __init__(self, name: str, cost: CostModel) -> None:
        self.name = name
        self.cost = cost
        self._report: object = None  # the routing stats last unpacked (identity tells a new report)
        self.held: frozenset = frozenset()  # key prefixes in its device pool, as last reported
        self.tier_held: dict[str, frozenset] = {}  # medium -> key prefixes its own lower tiers hold
        self.expected: dict[bytes, float] = {}  # key prefix -> time.monotonic() a request that stores it was routed
        self.outstanding: dict[object, float] = {}  # in-flight request id -> estimated seconds of work
        self.num_requests_waiting = 0
        self.kv_cache_usage = 0.0  # the share of its pool running requests hold (kv_aware prices misses by it)

    def take_report(self, stats: Optional[dict]) -> None:
        """Read the replica's latest routing stats (cheap when it is the same report as before)."""
        if not isinstance(stats, dict) or stats is self._report:
            return
        self._report = stats
        self.held = unpack_keys(stats.get("cache_keys"))
        tiers = stats.get("tier_keys")
        self.tier_held = (
            {medium: unpack_keys(blob) for medium, blob in tiers.items()} if isinstance(tiers, dict) else {}
        )
        waiting, usage = stats.get("num_requests_waiting"), stats.get("kv_cache_usage")
        self.num_requests_waiting = waiting if isinstance(waiting, int) else 0
        self.kv_cache_usage = float(usage) if isinstance(usage, (int, float)) and 0 <= usage <= 1 else 0.0
        recent = time.monotonic() - EXPECTED_KEY_SECONDS
        self.expected = {key: at for key, at in self.expected.items() if at >= recent}

    # -------------------------------------------------------- policies.ReplicaView
    @property
    def load(self) -> float:
        return sum(self.outstanding.values())

    def _holds(self, key: bytes) -> bool:
        prefix = key[:KEY_PREFIX_BYTES]
        return prefix in self.held or prefix in self.expected

    def num_hit_blocks(self, request: RouteRequest) -> int:
        limit = max_hit_blocks(request.num_blocks, 1, len(request.keys))
        for i in range(limit):
            if not self._holds(request.keys[i]):
                return i
        return limit

    def lower_tier_run(self, request: RouteRequest) -> list[tuple[str, int]]:
        """The run right after its device hit that its own host and disk tiers hold, as (tier, blocks)."""
        position = self.num_hit_blocks(request)
        limit = max_hit_blocks(request.num_blocks, 1, len(request.keys))
        run = []
        for medium, tier in LOWER_TIERS:
            held = self.tier_held.get(medium, frozenset())
            count = 0
            for key in request.keys[position:limit]:
                if key[:KEY_PREFIX_BYTES] not in held:
                    break
                count += 1
            if count:
                run.append((tier, count))
                position += count
        return run

    # ------------------------------------------------------------- the router's
    def routed(self, request_id: object, estimate: RouteEstimate) -> None:
        """A request was sent here: its work counts until `completed`, its keys as held until reported."""
        route = estimate.route
        hit_tokens = prompt_tokens = 0
        if route is not None:
            hit_tokens = self.num_hit_blocks(route) * route.tokens_per_block
            prompt_tokens = len(route.token_ids)
            now = time.monotonic()
            self.expected.update((key[:KEY_PREFIX_BYTES], now) for key in route.keys)
        self.outstanding[request_id] = self.cost.request_seconds(prompt_tokens, hit_tokens, estimate.max_tokens)

    def completed(self, request_id: object) -> None:
        self.outstanding.pop(request_id, None)


def ranked(views: Sequence[ReplicaCacheView], best: int, avoid: frozenset) -> list[int]:
    """Indices in the order to try: the policy's choice, then the rest by load, replicas to avoid last."""
    order = [best] + sorted((i for i in range(len(views)) if i != best), key=lambda i: views[i].load)
    return sorted(order, key=lambda i: views[i].name in avoid)  # stable: the order within each group stays
