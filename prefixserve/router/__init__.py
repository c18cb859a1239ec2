"""Routing across replicas: policies (shared with the HTTP router) and the fleet simulator (traces: prefixserve.traces)."""

from .policies import POLICIES, PolicyOptions, PrefixMirror, ReplicaView, RouteRequest, RoutingPolicy, make_policy

__all__ = [
    "POLICIES",
    "PolicyOptions",
    "PrefixMirror",
    "ReplicaView",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
