"""Routing across replicas: policies (shared with the HTTP router), traces and the fleet simulator."""

from .policies import POLICIES, PolicyOptions, PrefixMirror, ReplicaView, RouteRequest, RoutingPolicy, make_policy
from .traces import AgentTraceConfig, Trace, TraceFormatError, TraceRequest, generate_agent_trace, load_mooncake

__all__ = [
    "AgentTraceConfig",
    "POLICIES",
    "PolicyOptions",
    "PrefixMirror",
    "ReplicaView",
    "RouteRequest",
    "RoutingPolicy",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "generate_agent_trace",
    "load_mooncake",
    "make_policy",
]
