"""Pins: prefixes kept resident, with an optional TTL. Two kinds: the operator's (POST /v1/cache/pin, LLM.pin)
and a tenant's retention pins (Anthropic's cache_control breakpoints: `keep`).

A retention pin counts against its tenant's pin_share (cache/tenant_pins.py) and the operator's never fail
for lack of tenant room: when the cap is reached, the hot-prefix policy's pins go first, then retention
pins, oldest first, until the operator's fits.

A pin names a prompt's full blocks in one scope (a tenant's, or the public one). Making
one takes two steps, because a prefix can only be pinned once its blocks are cached:
the caller first runs the prompt through the engine (a one-token generation: a hit
when it is cached, a prefill otherwise), then `PinTable.pin` pins the cached path.

With a disk tier the table is saved beside the records (`pins.json`, written atomically)
and read back at start-up, so pins survive a restart: their blocks come back from disk
the first time they are warmed. Saved pins carry the tokenizer's fingerprint: after a
tokenizer change their token ids mean other text, so they are dropped, not restored.
The table runs on the engine thread (between steps); nothing here is thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ...cache.pin_counts import PinCapError
from ...cache.tenant_pins import TenantPins

logger = logging.getLogger("prefixserve")
PINS_FILE = "pins.json"
OPERATOR, RETENTION = "operator", "retention"  # Pin.kind


def claimant_of(tenant: Optional[str], kind: str) -> Optional[str]:
    """Whose pin_share a pin counts against: its tenant's for a retention pin; nobody's for the operator's."""
    return tenant if kind == RETENTION else None


@dataclass
class Pin:
    pin_id: str
    tenant: Optional[str]  # whose scope (None: the public, unsalted scope)
    salt: Optional[str]  # the scope salt the prompt was keyed with
    token_ids: list[int]
    num_blocks: int  # blocks pinned in the pool (0 while waiting to be warmed again)
    created_at: float  # unix seconds
    expires_at: Optional[float]  # unix seconds; None: until unpinned
    kind: str = OPERATOR  # OPERATOR | RETENTION (a tenant's cache_control: counts against its pin_share)

    def public(self) -> dict:
        """What an operator sees: never the token ids."""
        return {
            "id": self.pin_id,
            "object": "cache.pin",
            "tenant": self.tenant,
            "kind": self.kind,
            "num_tokens": len(self.token_ids),
            "num_blocks": self.num_blocks,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }


class PinTable:
    def __init__(
        self,
        cache,
        keyer,
        block_size: int,
        directory: Optional[str] = None,
        tokenizer_fingerprint: str = "",
        wall_clock=time.time,
        tenant_pins: Optional[TenantPins] = None,
        soft_pins=None,
    ) -> None:
        self.cache = cache
        self.keyer = keyer
        self.block_size = block_size
        self.path = Path(directory) / PINS_FILE if directory else None
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.wall_clock = wall_clock
        self.tenant_pins = tenant_pins  # retention pins within their tenant's pin_share
        self.soft_pins = soft_pins  # the hot-prefix policy (unpin_all(cache)): its pins give way to any pin here
        self.pins: dict[str, Pin] = {}
        self.to_restore: list[Pin] = self._load()  # saved pins not yet warmed again

    # ------------------------------------------------------------ pinning
    def pin(
        self,
        scoper,
        token_ids: list[int],
        tenant: Optional[str],
        salt: Optional[str],
        ttl: Optional[float],
        pin_id: Optional[str] = None,
        created_at: Optional[float] = None,
        kind: str = OPERATOR,
    ) -> Pin:
        """Pin the cached full blocks of `token_ids` in its scope; raises ValueError naming the fix (PinShareError
        past a retention pin's tenant share, PinCapError past the cap when nothing can give way)."""
        keys = self._keys(scoper, token_ids, salt)
        if not keys:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, less than one block of {self.block_size}; pin a longer prefix"
            )
        claimant = claimant_of(tenant, kind)
        if self.tenant_pins is not None:
            self.tenant_pins.claim(claimant, len(keys))
        try:
            num_blocks = self._pin_keys(keys, kind, scoper)
        except ValueError:
            self._unclaim(claimant, len(keys))
            raise
        self._unclaim(claimant, len(keys) - num_blocks)
        if num_blocks < len(keys):
            self.cache.unpin(keys[:num_blocks])
            self._unclaim(claimant, num_blocks)
            raise ValueError(
                f"only {num_blocks} of the prompt's {len(keys)} blocks are cached (the pool is too "
                "busy to keep it); retry, or raise kv_cache_memory_bytes"
            )
        now = self.wall_clock()
        pin = Pin(
            pin_id or "pin-" + uuid.uuid4().hex[:24],
            tenant,
            salt,
            list(token_ids),
            num_blocks,
            now if created_at is None else created_at,
            None if ttl is None else now + ttl,
            kind,
        )
        self.pins[pin.pin_id] = pin
        self._save()
        return pin

    def _pin_keys(self, keys: list[bytes], kind: str, scoper) -> int:
        """cache.pin(keys), making room at the cap: the hot-prefix policy's pins give way to any pin, and for
        the operator's, retention pins too, oldest first."""
        while True:
            try:
                return self.cache.pin(keys)
            except PinCapError:
                if self.soft_pins is not None and self.soft_pins.unpin_all(self.cache):
                    continue
                retention = [pin for pin in self.pins.values() if pin.kind == RETENTION and pin.num_blocks]
                if kind != OPERATOR or not retention:
                    raise
                oldest = min(retention, key=lambda pin: pin.created_at)
                logger.info("pin %s (tenant %r) gives way to an operator pin at the cap", oldest.pin_id, oldest.tenant)
                self.unpin(oldest.pin_id, scoper)

    def _unclaim(self, claimant: Optional[str], num_blocks: int) -> None:
        if self.tenant_pins is not None:
            self.tenant_pins.release(claimant, num_blocks)

    def keep(self, scoper, token_ids: list[int], tenant: Optional[str], salt: Optional[str], ttl: float) -> Pin:
        """Keep `token_ids` pinned for at least `ttl` seconds more: the pin of this very prefix has its expiry
        pushed out (a cache_control breakpoint hit again), else a new pin is made. ValueError as pin()."""
        for pin in self.pins.values():
            if pin.tenant == tenant and pin.salt == salt and pin.token_ids == token_ids:
                if pin.expires_at is not None:
                    pin.expires_at = max(pin.expires_at, self.wall_clock() + ttl)
                    self._save()
                return pin
        return self.pin(scoper, token_ids, tenant, salt, ttl, kind=RETENTION)

    def unpin(self, pin_id: str, scoper) -> Optional[Pin]:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self._release(pin, scoper)
            self._save()
        return pin

    def expire(self, scoper) -> int:
        """Unpin every pin past its expiry; returns how many."""
        now = self.wall_clock()
        expired = [pin for pin in self.pins.values() if pin.expires_at is not None and pin.expires_at <= now]
        for pin in expired:
            del self.pins[pin.pin_id]
            self._release(pin, scoper)
        self.to_restore = [pin for pin in self.to_restore if pin.expires_at is None or pin.expires_at > now]
        if expired:
            self._save()
        return len(expired)

    def _release(self, pin: Pin, scoper) -> None:
        if pin.num_blocks:
            self.cache.unpin(self._keys(scoper, pin.token_ids, pin.salt)[: pin.num_blocks])
            self._unclaim(claimant_of(pin.tenant, pin.kind), pin.num_blocks)

    def _keys(self, scoper, token_ids: list[int], salt: Optional[str]) -> list[bytes]:
        """The block keys of `token_ids` in the scope a request with this salt gets."""
        scope_digest, private_from = scoper.scope_for(token_ids, salt)
        return self.keyer.keys(scope_digest, token_ids, private_from)

    def on_cleared(self, tokenizer_fingerprint: str) -> None:
        """The pool was cleared by a reload: every pin is to be warmed again on the new version,
        if its token ids still mean the same text."""
        pins = list(self.pins.values())
        self.pins.clear()
        if tokenizer_fingerprint != self.tokenizer_fingerprint:
            if pins:
                logger.warning("reload: the tokenizer changed, so %d pins were dropped; pin them again", len(pins))
            pins = []
        self.tokenizer_fingerprint = tokenizer_fingerprint
        for pin in pins:
            self._unclaim(claimant_of(pin.tenant, pin.kind), pin.num_blocks)
            pin.num_blocks = 0
        self.to_restore = pins + self.to_restore
        self._save()

    def listing(self) -> list[dict]:
        waiting = [dict(pin.public(), restoring=True) for pin in self.to_restore]
        return [pin.public() for pin in self.pins.values()] + waiting

    # --------------------------------------------------------- persistence
    def _save(self) -> None:
        if self.path is None:
            return
        body = {
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "pins": [asdict(pin) for pin in [*self.pins.values(), *self.to_restore]],
        }
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            temporary.write_text(json.dumps(body))
            os.replace(temporary, self.path)
        except OSError as error:  # a pin still holds in memory; only its restart survival is lost
            logger.warning("could not save pins to %s (%s); they will not survive a restart", self.path, error)

    def _load(self) -> list[Pin]:
        if self.path is None or not self.path.exists():
            return []
        try:
            body = json.loads(self.path.read_text())
            if body.get("tokenizer_fingerprint") != self.tokenizer_fingerprint:
                logger.warning("%s was saved for another tokenizer; its pins are dropped", self.path)
                return []
            pins = [Pin(**{**entry, "num_blocks": 0}) for entry in body["pins"]]
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            logger.warning("could not read saved pins from %s (%s); starting without them", self.path, error)
            return []
        now = self.wall_clock()
        return [pin for pin in pins if pin.expires_at is None or pin.expires_at > now]


def restore_pins(engine) -> int:
    """Warm `engine`'s pins waiting to be restored (a one-token generation each: a hit from the disk
    tier after a restart, a prefill after a reload) and pin them again; call with no request in
    flight. Returns how many were restored; one that cannot be is logged and dropped."""
    from ..sampling_params import SamplingParams

    table = engine.pins
    waiting, table.to_restore = table.to_restore, []
    warmers = [engine.add_request(pin.token_ids, SamplingParams(max_tokens=1), cache_salt=pin.salt) for pin in waiting]
    engine.run_until_finished([request.request_id for request in warmers])
    num_restored = 0
    now = table.wall_clock()
    for pin in waiting:
        ttl = None if pin.expires_at is None else pin.expires_at - now
        if ttl is not None and ttl <= 0:
            continue
        try:
            table.pin(engine.scoper, pin.token_ids, pin.tenant, pin.salt, ttl, pin.pin_id, pin.created_at, pin.kind)
            num_restored += 1
        except ValueError as error:
            logger.warning("could not restore pin %s: %s", pin.pin_id, error)
    return num_restored
