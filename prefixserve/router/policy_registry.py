"""Every routing policy by name: ours (policies.py) and, for the simulator, the gateways' scorers
(gateway_policies.py)."""

from __future__ import annotations

from typing import Optional

from .gateway_policies import GATEWAY_POLICIES
from .policies import POLICIES, RoutingPolicy
from .policy_options import PolicyOptions


def make_policy(name: str, options: Optional[PolicyOptions] = None) -> RoutingPolicy:
    """Ours by name, or a gateway's scorer for the simulator."""
    factory = POLICIES.get(name) or GATEWAY_POLICIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}, or for the "
            f"simulator one of the gateways' {', '.join(GATEWAY_POLICIES)}"
        )
    return factory(options or PolicyOptions())
