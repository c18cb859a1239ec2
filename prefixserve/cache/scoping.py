"""Which scope a prompt's key chain starts in: shared by the engine and the router, so their keys agree.

Without a salt a prompt is keyed in the model's scope. A salt (tenant, or a
caller's cache_salt) gives it a private scope, except that a declared public
prefix (an operator's system prompt) stays in the shared scope and the
tenant's chain forks right after it (see BlockKeyer.extend).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Optional, Sequence

from .keys import CacheScope, PrivateFrom


def compose_salt(tenant: Optional[str], cache_salt: Optional[str]) -> Optional[str]:
    """The salt of a (tenant, cache_salt) pair: None when neither is set, else an encoding no two pairs share.

    Each part is written as its length, a colon and its characters ('-' when absent),
    so no choice of tenant id and cache_salt can imitate another pair: tenant 'acme'
    with salt 'eu' and tenant 'acme\\x00eu' without one get different scopes.
    """
    if tenant is None and not cache_salt:
        return None
    return f"tenant={_length_prefixed(tenant)};salt={_length_prefixed(cache_salt or None)}"


def long_rope_scope(digest: bytes) -> bytes:
    """The scope of a LongRoPE sequence rotated with the long factors (model/families/rope.py): its K/V differs from the
    same tokens' under the short ones, so its keys must too."""
    return hashlib.sha256(b"prefixserve long rope\0" + digest).digest()


def _length_prefixed(part: Optional[str]) -> str:
    return "-" if part is None else f"{len(part)}:{part}"


class PromptScoper:
    def __init__(self, scope: CacheScope, block_size: int) -> None:
        self.scope = scope
        self.block_size = block_size
        self.shared_prefixes: list[list[int]] = []  # longest first, whole blocks only

    def declare_shared_prefix(self, token_ids: Sequence[int]) -> int:
        """Let every salt reuse the full blocks of this public prefix; returns how many blocks that is."""
        num_blocks = len(token_ids) // self.block_size
        prefix = list(token_ids[: num_blocks * self.block_size])
        if num_blocks and prefix not in self.shared_prefixes:
            self.shared_prefixes.append(prefix)
            self.shared_prefixes.sort(key=len, reverse=True)
        return num_blocks

    def scope_for(
        self, token_ids: Sequence[int], salt: Optional[str], adapter_id: str = ""
    ) -> tuple[bytes, Optional[PrivateFrom]]:
        """(digest that block 0 chains from, where the private chain forks or None). Under a LoRA adapter
        (`adapter_id`: its weights' fingerprint) every block, a public prefix's too, is keyed in that adapter's
        scope: its K/V differs from the base's."""
        scope = replace(self.scope, adapter_id=adapter_id) if adapter_id else self.scope
        if not salt:
            return scope.digest, None
        private_digest = scope.with_salt(salt).digest
        for prefix in self.shared_prefixes:
            if list(token_ids[: len(prefix)]) == prefix:
                return scope.digest, (len(prefix) // self.block_size, private_digest)
        return private_digest, None
