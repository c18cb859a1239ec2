"""Block keys a router computes for a prompt, equal to a replica's: its scope, block size and shared prefixes,
read from the replica's /v1/cache/info body (the HTTP router's, and the Ray ingress's), and the fingerprints of
the LoRA adapters it serves by name: a request for an adapter is keyed in that adapter's scope, so it goes where
that adapter's prefix is cached (adapter affinity), never to where the base's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..cache import BlockKeyer, CacheScope
from ..cache.scoping import PromptScoper
from .policies import RouteRequest


@dataclass(frozen=True)
class RouteKeys:
    scoper: PromptScoper
    keyer: BlockKeyer
    adapters: dict = field(default_factory=dict, compare=False)  # LoRA model name -> its weights' fingerprint

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
        adapters = info.get("lora_adapters") or {}
        if not isinstance(adapters, dict) or not all(isinstance(v, str) for v in adapters.values()):
            raise ValueError("lora_adapters must map adapter names to fingerprints")
        return cls(scoper, BlockKeyer(info["block_size"], info["prefix_hash"]), dict(adapters))

    def route_request(
        self, token_ids: list[int], salt: Optional[str], model: Optional[str] = None
    ) -> Optional[RouteRequest]:
        """The prompt's keys as the replica will compute them (None for an empty prompt); `model`: the model
        name it asks for (an adapter's name keys it in that adapter's scope)."""
        if not token_ids:
            return None
        adapter_id = self.adapters.get(model, "") if model is not None else ""
        scope_digest, private_from = self.scoper.scope_for(token_ids, salt, adapter_id)
        keys = self.keyer.keys(scope_digest, token_ids, private_from)
        size = self.keyer.block_size
        return RouteRequest(keys, token_ids, scope_digest, -(-len(token_ids) // size), size)
