"""Whose the device pool's cached blocks are: each tenant's held and unreferenced blocks, and so what another's
need may evict (tenant_shares.py says the shares; the radix index tells this what changes)."""

from __future__ import annotations

from typing import Optional

from .pin_counts import PinCounts
from .tenant_shares import TenantHoldings, TenantShares


class TenantBlocks:
    def __init__(self, shares: TenantShares, num_blocks: int) -> None:
        self.holdings = TenantHoldings(shares, num_blocks)  # cached blocks by tenant, against min/max
        self.unreferenced: dict[Optional[str], int] = {}  # cached blocks no request holds, by tenant

    def count_unreferenced(self, owner: Optional[str], delta: int) -> None:
        self.unreferenced[owner] = self.unreferenced.get(owner, 0) + delta

    def guarded_for(self, requester: Optional[str], pins: PinCounts) -> int:
        """Reclaimable blocks `requester`'s need may not evict: another tenant's, as far as they keep it at its
        minimum."""
        guarded = 0
        for owner, minimum in self.holdings.guarded():
            if owner != requester:
                reclaimable = self.unreferenced.get(owner, 0) - pins.unreferenced_of(owner)
                guarded += reclaimable - min(reclaimable, max(0, self.holdings.held[owner] - minimum))
        return guarded
