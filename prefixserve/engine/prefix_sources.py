"""Where a waiting request's prefix can come from: the one interface the scheduler asks at admission.

    device radix (held now, free) ─> host ─> disk ─> remote      each continuing where the one before stopped

`find(request)` says how many blocks each source holds in chain order and what the fetch planner
(tiers/policy.py, kv_fetch_policy) chose to read of the tiers' part, at what estimated cost against
recomputing it: a PrefixFind. `ready_prefix(request)` is what admission calls: it finds, loads the chosen
part, and answers the device blocks the request can be admitted on now, or None while it waits. A synchronous
tier's blocks are loaded at once, as ordinary cached blocks of the radix; an asynchronous tier's are read on its
thread while the request is RequestStatus.WAITING_FOR_KV, until `collect` (at the start of every schedule) sees
the read back or gives up on it. This is the question vLLM's scheduler asks its KV connector
(get_num_new_matched_tokens) and the state it gives a request waiting for remote KV.

Plain Python: the tiers' side (engine/tier_reader.py) is handed in as LowerTiers; a pool with nothing below it
hands in NO_LOWER_TIERS, which holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from ..cache import Block, BlockKeyer, RadixCache, max_hit_blocks
from .request import Request, RequestStatus
from .request_windows import RequestWindows


@dataclass(frozen=True)
class SourceRun:
    """Blocks of a request's prefix one tier holds, continuing where the source before it stopped."""

    source: str  # the tier's name
    num_blocks: int  # held
    num_chosen: int  # of those, what the planner reads back (the rest, and all after, is recomputed)


@dataclass
class PrefixFind:
    """A request's prefix by source: the device's usable match, then the tiers' run after it."""

    device: list[Block]
    lower: list[SourceRun] = field(default_factory=list)  # nearest tier first; empty: none, or asked before
    keys: list[bytes] = field(default_factory=list)  # the keys a hit may cover (when the tiers were asked)
    fetch_seconds: float = 0.0  # the planner's estimate for the chosen blocks
    recompute_seconds: float = 0.0  # and for computing the run's blocks it did not choose

    @property
    def num_chosen_blocks(self) -> int:
        return sum(run.num_chosen for run in self.lower)

    def blocks_by_source(self) -> dict[str, int]:
        """{"device": n, tier: held, ...}: how much of the prefix each source holds."""
        return {"device": len(self.device), **{run.source: run.num_blocks for run in self.lower}}


class LowerTiers(Protocol):
    """The tiers below the pool, as admission asks them (engine/tier_reader.py's TierReader)."""

    def find(
        self, request: Request, keys: Sequence[bytes], start: int
    ) -> tuple[list[SourceRun], float, float]: ...  # runs, fetch seconds, recompute seconds; asked once a request

    def load(self, request: Request, keys: Sequence[bytes], start: int, runs: Sequence[SourceRun]) -> None: ...

    def collect(self) -> None: ...

    def wait_for_reads(self) -> None: ...

    @property
    def has_pending_reads(self) -> bool: ...


class NoLowerTiers:
    """Nothing below the pool: nothing found, nothing to load or wait for."""

    def find(self, request: Request, keys: Sequence[bytes], start: int) -> tuple[list[SourceRun], float, float]:
        return [], 0.0, 0.0

    def load(self, request: Request, keys: Sequence[bytes], start: int, runs: Sequence[SourceRun]) -> None:
        raise ValueError("nothing lies below this pool to load from")

    def collect(self) -> None:
        pass

    def wait_for_reads(self) -> None:
        pass

    @property
    def has_pending_reads(self) -> bool:
        return False


NO_LOWER_TIERS = NoLowerTiers()


class PrefixSources:
    """The device radix, then the tiers below it: how much of a waiting request's prefix each holds."""

    def __init__(
        self,
        cache: RadixCache,
        keyer: BlockKeyer,
        windows: RequestWindows,
        enable_prefix_caching: bool = True,
        lower: LowerTiers = NO_LOWER_TIERS,
    ) -> None:
        self.cache, self.keyer, self.windows = cache, keyer, windows
        self.enable_prefix_caching = enable_prefix_caching
        self.lower = lower

    def device_match(self, request: Request) -> list[Block]:
        """The request's cached prefix on the device, cut to what the window layers' pool still holds."""
        if not self.enable_prefix_caching:
            return []
        self.keyer.extend(request.block_keys, request.scope_digest, request.token_ids, request.private_from)
        match = self.cache.match(request.scope_digest, request.block_keys, request.token_ids, record_stats=False)
        return self.windows.usable(match.blocks)

    def find(self, request: Request, ask_lower: bool = True) -> PrefixFind:
        """The device's match, then (when `ask_lower`, once a request, never for one admitted before) the tiers'
        run past it and the planner's choice."""
        found = PrefixFind(self.device_match(request))
        if self.enable_prefix_caching and ask_lower and not request.was_admitted:
            found.keys = self._hit_keys(request)
            found.lower, found.fetch_seconds, found.recompute_seconds = self.lower.find(
                request, found.keys, len(found.device)
            )
        return found

    def ready_prefix(self, request: Request, ask_lower: bool = True) -> Optional[list[Block]]:
        """The device blocks `request` can be admitted on now, after loading what the planner chose from the
        tiers; None when it now waits for an asynchronous read (RequestStatus.WAITING_FOR_KV)."""
        found = self.find(request, ask_lower)
        if not found.num_chosen_blocks:
            return found.device
        self.lower.load(request, found.keys, len(found.device), found.lower)
        if request.status is RequestStatus.WAITING_FOR_KV:
            return None
        return self.device_match(request)  # what was loaded now hangs from the device's match

    def collect(self) -> None:
        """Reads that came back are loaded (their requests wait no more); reads past the deadline are given up."""
        self.lower.collect()

    def wait_for_reads(self) -> None:
        """Nothing could be scheduled: wait briefly for a read instead of spinning."""
        if self.lower.has_pending_reads:
            self.lower.wait_for_reads()

    def _hit_keys(self, request: Request) -> list[bytes]:
        keys = request.block_keys  # extended by device_match
        return keys[: max_hit_blocks(request.num_prompt_tokens, self.cache.block_size, len(keys))]
