"""Each tenant's shares and what it holds against them, with its cache counters: the operator's view of fairness
(GET /v1/cache/stats, /metrics behind the operator's keys, the dashboard). Built on the engine thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import LLMEngine


def tenant_report(engine: "LLMEngine") -> dict:
    """{"shares": the configured shares, "tenants": tenant -> {"pool", "pins", "tiers", "counters"}} for every
    tenant that holds, pins or asked for anything: blocks of the pool and of the pin cap, bytes of each tier."""
    cache = engine.cache
    holdings = cache.tenants.holdings
    tenant_pins = engine.pins.tenant_pins
    tier_holdings = {name: tier.tenant_holdings() for name, tier in engine.tiers.tiers.items()}
    counters = cache.stats.tenants_dict()
    names = set(holdings.held) | set(counters)
    if tenant_pins is not None:
        names |= set(tenant_pins.held)
    for held in tier_holdings.values():
        names |= set(held)
    tenants = {}
    for tenant in sorted(names):
        pins = tenant_pins.report().get(tenant) if tenant_pins is not None else None
        tenants[tenant] = {
            "pool": {
                "held": holdings.held.get(tenant, 0),
                "min": holdings.minimum(tenant),
                "max": holdings.maximum(tenant),
            },
            "pins": pins
            or {"pinned": 0, "limit": cache.pins.max_blocks if tenant_pins is None else tenant_pins.limit(tenant)},
            "tiers": {name: held[tenant] for name, held in tier_holdings.items() if tenant in held},
            "counters": counters.get(tenant, {}),
        }
    return {"shares": holdings.shares.to_dict(), "tenants": tenants}
