"""Fair shares between tenants of one cache: how much of the pin cap each may take, and how much of a store
(the device pool, the host or disk tier) each keeps against the others' traffic and may hold at most.

Without shares, one tenant's cache_control pins can take the whole pin cap for an hour, and a flood of its
one-off prompts evicts every other tenant's warm prefixes by LRU (Mooncake keeps per-tenant quotas; vLLM and
SGLang have none). A share is three fractions, set per tenant in the keys file beside cache_ttl, with a
server-wide default for tenants that set nothing:

    pin_share      at most this fraction of the pin cap (max_pinned_blocks) is held by the tenant's
                   pins: cache_control / retention pins and hot-prefix pins of its private prefixes
                   (the operator's pins count against nobody, and never fail for lack of tenant room)
    min_kv_share   this fraction of a store is the tenant's minimum: while it holds no more, another
                   tenant's traffic (or untenanted traffic) cannot evict its blocks; its own can
    max_kv_share   it holds at most this fraction of a store: past it, its own coldest blocks make room,
                   else the new block is served and not cached (recomputed next time, never refused)

A block belongs to the tenant whose private (salted) scope it is keyed in; the blocks of a declared public
prefix and of requests without a tenant belong to nobody and count against no share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Optional

MAX_TOTAL_MIN_KV_SHARE = 0.9  # the minimums together leave a tenth of every store to running requests
DEFAULT_PIN_SHARE = 0.25  # with a keys file, no tenant's pins take more than a quarter of the cap by default


@dataclass(frozen=True)
class Share:
    pin_share: float = DEFAULT_PIN_SHARE
    min_kv_share: float = 0.0
    max_kv_share: float = 1.0

    def problem(self) -> Optional[str]:
        """Why this share cannot hold, naming the field; None when it can."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                return f"{field.name} must be a fraction from 0 to 1, got {value!r}"
        if self.min_kv_share > self.max_kv_share:
            return f"min_kv_share ({self.min_kv_share:g}) must not exceed max_kv_share ({self.max_kv_share:g})"
        return None


class TenantShares:
    """tenant -> Share (the keys file's), else the server's default; a block of nobody (None) has no share."""

    def __init__(self, shares: Optional[Mapping[str, Share]] = None, default: Optional[Share] = None) -> None:
        self.shares = dict(shares or {})
        self.default = default or Share()
        for tenant, share in [*self.shares.items(), ("(default)", self.default)]:
            problem = share.problem()
            if problem:
                raise ValueError(f"tenant {tenant!r}: {problem}")
        total = sum(share.min_kv_share for share in self.shares.values())
        if total > MAX_TOTAL_MIN_KV_SHARE + 1e-9:
            raise ValueError(
                f"the tenants' min_kv_share add up to {total:g}; keep them at most {MAX_TOTAL_MIN_KV_SHARE:g} "
                "together, so that running requests always find room"
            )

    def of(self, tenant: Optional[str]) -> Optional[Share]:
        if tenant is None:
            return None
        return self.shares.get(tenant, self.default)

    @property
    def guards_minimums(self) -> bool:
        """Whether any tenant has a minimum (else eviction never needs to ask whose a block is)."""
        return self.default.min_kv_share > 0 or any(share.min_kv_share > 0 for share in self.shares.values())

    def pin_limit(self, tenant: Optional[str], max_pinned_blocks: int) -> Optional[int]:
        share = self.of(tenant)
        return None if share is None else math.floor(share.pin_share * max_pinned_blocks)

    def to_dict(self) -> dict:
        def plain(share: Share) -> dict:
            return {field.name: getattr(share, field.name) for field in fields(share)}

        return {"default": plain(self.default), "tenants": {t: plain(s) for t, s in sorted(self.shares.items())}}


NO_SHARES = TenantShares()


class TenantHoldings:
    """What each tenant holds in one store of `capacity` units (blocks of the device pool, bytes of a tier),
    against its minimum and maximum. The store tells it what enters and leaves; it answers who may evict whom."""

    def __init__(self, shares: TenantShares, capacity: int) -> None:
        self.shares = shares
        self.capacity = capacity
        self.held: dict[str, int] = {}

    def add(self, owner: Optional[str], amount: int) -> None:
        if owner is not None:
            self.held[owner] = self.held.get(owner, 0) + amount

    def remove(self, owner: Optional[str], amount: int) -> None:
        if owner is not None:
            left = self.held.get(owner, 0) - amount
            if left > 0:
                self.held[owner] = left
            else:
                self.held.pop(owner, None)

    def minimum(self, owner: Optional[str]) -> int:
        share = self.shares.of(owner)
        return 0 if share is None else math.floor(share.min_kv_share * self.capacity)

    def maximum(self, owner: Optional[str]) -> Optional[int]:
        share = self.shares.of(owner)
        if share is None or share.max_kv_share >= 1:
            return None
        return math.floor(share.max_kv_share * self.capacity)

    def evictable_by(self, owner: Optional[str], requester: Optional[str], amount: int = 1) -> bool:
        """Whether `requester`'s need may evict `amount` units of `owner`'s: its own always, another's as long as
        it keeps its minimum."""
        return owner is None or owner == requester or self.held.get(owner, 0) - amount >= self.minimum(owner)

    def over_maximum(self, owner: Optional[str], amount: int) -> bool:
        """Whether holding `amount` more units would take `owner` past its maximum."""
        maximum = self.maximum(owner)
        return maximum is not None and self.held.get(owner, 0) + amount > maximum

    def guarded(self) -> list[tuple[str, int]]:
        """(tenant, minimum) of every tenant holding something under a minimum above zero."""
        return [(owner, minimum) for owner in self.held if (minimum := self.minimum(owner)) > 0]

    def report(self) -> dict:
        """tenant -> {held, min, max} for the tenants holding something (the stats and dashboard show it)."""
        return {
            owner: {"held": held, "min": self.minimum(owner), "max": self.maximum(owner)}
            for owner, held in sorted(self.held.items())
        }


SHARE_FIELDS = tuple(field.name for field in fields(Share))


def share_from(fields_given: Mapping, default: Share, where: str) -> Share:
    """A Share of `fields_given` (a keys-file entry's or --tenant-shares' fields), the rest from `default`;
    ValueError naming `where` and the field at fault."""
    import dataclasses

    share = dataclasses.replace(default, **{name: fields_given[name] for name in SHARE_FIELDS if name in fields_given})
    problem = share.problem()
    if problem:
        raise ValueError(f"{where}: {problem}")
    return share


def parse_tenant_shares(value) -> Optional[dict]:
    """--tenant-shares: JSON text or a dict, tenant -> {"pin_share", "min_kv_share", "max_kv_share"} (each
    optional, fractions from 0 to 1), kept as tenant -> the fields given (the defaults fill the rest:
    EngineConfig.shares)."""
    import json

    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"tenant_shares is not valid JSON ({error}); give tenant -> {{pin_share: ...}}") from None
    if not isinstance(value, dict):
        raise ValueError(f"tenant_shares must be a JSON object of tenant -> shares, got {type(value).__name__}")
    for tenant, given in value.items():
        if not isinstance(given, dict) or set(given) - set(SHARE_FIELDS):
            raise ValueError(
                f"tenant_shares[{tenant!r}] must be an object with some of {list(SHARE_FIELDS)}, got {given!r:.120}"
            )
    return {tenant: dict(given) for tenant, given in value.items()}


def tenant_shares_of(given: Optional[Mapping[str, Mapping]], default: Share) -> TenantShares:
    """TenantShares of tenant -> the fields each gives (parse_tenant_shares), `default` filling the rest."""
    shares = {
        tenant: share_from(fields_given, default, f"tenant {tenant!r}")
        for tenant, fields_given in (given or {}).items()
    }
    return TenantShares(shares, default)
