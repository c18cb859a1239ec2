"""Block keys a router computes for a prompt, equal to a replica's: its scope, block size and shared prefixes,
read from the replica's /v1/cache/info body (the HTTP router's, and the Ray ingress's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..cache import BlockKeyer, CacheScope
from ..cache.scoping import PromptScoper
from .policies import RouteRequest


@dataclass(frozen=True)
class RouteKeys:
    scoper: PromptScoper
    keyer: BlockKeyer

    @classmethod
    def of(cls, info: dict) -> "RouteKeys":
        """From a /v1/cache/info body (KeyError, TypeError or ValueError when it is not one)."""
        scoper = PromptScoper(
            CacheScope(
                info["model_fingerprint"],
                info["tokenizer_fingerprint"],
                info["adapter_id"],
                numerics=info.get("numerics", ""),
            ),
            info["block_size"],
        )
        for prefix in info["shared_prefixes"]:
            scoper.declare_shared_prefix(prefix)
        return cls(scoper, BlockKeyer(info["block_size"], info["prefix_hash"]))

    def route_request(self, token_ids: list[int], salt: Optional[str]) -> Optional[RouteRequest]:
        """The prompt's keys as the replica will compute them (None for an empty prompt)."""
        if not token_ids:
            return None
        scope_digest, private_from = self.scoper.scope_for(token_ids, salt)
        keys = self.keyer.keys(scope_digest, token_ids, private_from)
        size = self.keyer.block_size
        return RouteRequest(keys, token_ids, scope_digest, -(-len(token_ids) // size), size)
