"""Routing across replicas: the policies the HTTP router, Ray's request router and the simulator share."""

from .policies import POLICIES, ReplicaView, RouteRequest, RoutingPolicy
from .policy_options import PolicyOptions
from .policy_registry import make_policy
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
