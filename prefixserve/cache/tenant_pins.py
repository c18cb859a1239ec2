"""What each tenant's pins hold, against its pin_share of the pin cap (tenant_shares.py).

Two pinners claim here before they pin and release what they unpin: the pin table's retention pins (a
tenant's cache_control breakpoints, operations/pins.py) and the hot-prefix policy's pins of a tenant's
private prefixes (hot_prefixes.py). The operator's pins claim nothing: they count against the cap alone,
and tenant pins give way to them. A claim counts a pin's whole path, so two pins sharing blocks count
them twice: a tenant never holds more than its share, whatever the overlap.
"""

from __future__ import annotations

from typing import Optional

from .tenant_shares import TenantShares


class PinShareError(ValueError):
    """A tenant's pin past its pin_share: the message names the share and the fix."""


class TenantPins:
    def __init__(self, shares: TenantShares, max_pinned_blocks: int) -> None:
        self.shares = shares
        self.max_pinned_blocks = max_pinned_blocks
        self.held: dict[str, int] = {}

    def limit(self, tenant: Optional[str]) -> Optional[int]:
        return self.shares.pin_limit(tenant, self.max_pinned_blocks)

    def has_room(self, tenant: Optional[str], num_blocks: int) -> bool:
        limit = self.limit(tenant)
        return limit is None or self.held.get(tenant, 0) + num_blocks <= limit

    def claim(self, tenant: Optional[str], num_blocks: int) -> None:
        """Count `num_blocks` more against `tenant`'s share; PinShareError (nothing counted) past it."""
        if tenant is None:
            return
        if not self.has_room(tenant, num_blocks):
            raise PinShareError(
                f"tenant {tenant!r} already pins {self.held.get(tenant, 0)} blocks; {num_blocks} more would pass "
                f"its pin_share of {self.limit(tenant)} blocks (of max_pinned_blocks={self.max_pinned_blocks}); "
                "let older pins expire, or raise its pin_share in the keys file"
            )
        self.held[tenant] = self.held.get(tenant, 0) + num_blocks

    def release(self, tenant: Optional[str], num_blocks: int) -> None:
        if tenant is None or not num_blocks:
            return
        left = self.held.get(tenant, 0) - num_blocks
        assert left >= 0, f"tenant {tenant!r} released more pinned blocks than it claimed"
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]

    def report(self) -> dict:
        """tenant -> {pinned, limit} for the tenants whose pins hold something."""
        return {tenant: {"pinned": held, "limit": self.limit(tenant)} for tenant, held in sorted(self.held.items())}
