"""Routing across replicas: policies (shared with the HTTP router), traces and the fleet simulator."""

from .policies import POLICIES, PolicyOptions, PrefixMirror, ReplicaView, RouteRequest, RoutingPolicy, make_policy
from .agent_traces import AgentTraceConfig, generate_agent_trace, parse_agent_knobs
from .traces import Trace, TraceFormatError, TraceRequest, load_mooncake

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
    "parse_agent_knobs",
]
