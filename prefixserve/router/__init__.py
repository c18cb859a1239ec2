"""Routing across replicas: policies (shared with the HTTP router) and the fleet simulator (traces: traces/)."""

from .policies import POLICIES, ReplicaView, RouteRequest, RoutingPolicy, make_policy
from .policy_options import PolicyOptions
from .prefix_mirror import PrefixMirror

__all__ = [
    "POLICIES",
    "PolicyOptions",
    "PrefixMirror",
    "ReplicaView",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
