"""OpenAI's prompt_cache_key as the router reads it: a hint to keep requests that share it on one replica.

Requests with the same key go to the same replica (rendezvous hashing over the healthy candidates, so
a replica leaving or joining moves only its own keys), unless that replica is overloaded: more than
`slack` seconds of outstanding work above the least loaded candidate, when the request overflows to
the routing policy, as OpenAI documents for a key sent more than about 15 times a minute. The key
scopes nothing: which KV a request may reuse is the tenant's and the cache_salt's business.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from .replicas import Replica


def affinity(cache_key: str, replica_name: str) -> int:
    digest = hashlib.blake2b(f"{cache_key}\0{replica_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def keyed_replica(cache_key: str, candidates: Sequence[Replica], slack: float) -> Optional[Replica]:
    """The replica `cache_key` belongs to among `candidates`, or None when it is overloaded."""
    preferred = max(candidates, key=lambda replica: affinity(cache_key, replica.name))
    if preferred.load > min(replica.load for replica in candidates) + slack:
        return None
    return preferred
