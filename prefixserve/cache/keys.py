"""Scoped, block-chained prefix keys.

A block's key commits to every token before it and in it, and to the scope the
KV was computed in:

    scope digest ──H──> key 0 ──H──> key 1 ──H──> key 2 ...
                   ▲              ▲              ▲
            tokens [0,16)   tokens [16,32)  tokens [32,48)

so two prompts share key i exactly when their first (i+1)*block_size tokens are
identical and they run through the same model, tokenizer, adapter and tenant.
Only full blocks get keys; a partial tail block is never cached.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

HashFunction = Callable[[bytes], bytes]
PrivateFrom = Tuple[int, bytes]  # (first private block index, private scope digest)

_SCOPE_DOMAIN = b"prefixserve-scope-v2"  # v2: the numerics field


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional speed-up; imported lazily so SHA-256 users never need it

    return xxhash.xxh3_128_digest(data)


# SHA-256 is the default because it is collision resistant: a tenant cannot craft
# a prompt whose key equals another tenant's. xxh3-128 is several times faster
# but not cryptographic; token ids are still compared on every hit, so a
# collision costs a miss, never wrong KV.
HASH_FUNCTIONS: dict[str, HashFunction] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


def resolve_hash_function(hash_function: str | HashFunction) -> HashFunction:
    if callable(hash_function):
        return hash_function
    try:
        return HASH_FUNCTIONS[hash_function]
    except KeyError:
        raise ValueError(
            f"unknown prefix hash function {hash_function!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def max_hit_blocks(num_prompt_tokens: int, block_size: int, num_keys: int) -> int:
    """The one last-token rule: how many leading blocks of a prompt a prefix hit may cover.

    Only full blocks have keys, and the last prompt token is always computed (its logits give the
    first output token), so a prompt of n tokens hits at most (n - 1) // block_size of its `num_keys`
    full blocks. A trace replay whose "tokens" are block ids passes block_size 1 and its block count.
    """
    return max(0, min(num_keys, (num_prompt_tokens - 1) // block_size))


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes: the hashed and the stored form of a block."""
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(token_bytes: bytes) -> list[int]:
    """The token ids of a block's stored form (pack_tokens reversed)."""
    unpacked = array("I")
    unpacked.frombytes(token_bytes)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


@dataclass(frozen=True)
class CacheScope:
    """Everything besides the tokens that decides whether stored KV is reusable."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    adapter_id: str = ""
    cache_salt: str = ""
    numerics: str = ""  # how the engine computes K/V (dtype, kernel variant, libraries): engine/numerics.py

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("CacheScope needs a model_fingerprint (config + weights digest)")
        if not self.tokenizer_fingerprint:
            raise ValueError("CacheScope needs a tokenizer_fingerprint")

    @property
    def digest(self) -> bytes:
        """SHA-256 of the length-prefixed fields: the parent key of block 0."""
        hasher = hashlib.sha256(_SCOPE_DOMAIN)
        for field in (
            self.model_fingerprint,
            self.tokenizer_fingerprint,
            self.adapter_id,
            self.cache_salt,
            self.numerics,
        ):
            encoded = field.encode("utf-8")
            hasher.update(len(encoded).to_bytes(4, "little"))
            hasher.update(encoded)
        return hasher.digest()

    def with_salt(self, cache_salt: str) -> "CacheScope":
        return CacheScope(
            self.model_fingerprint, self.tokenizer_fingerprint, self.adapter_id, cache_salt, self.numerics
        )


class BlockKeyer:
    """Turns token lists into full-block keys, whole or incrementally."""

    def __init__(self, block_size: int = 16, hash_function: str | HashFunction = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.hash_function = resolve_hash_function(hash_function)

    def block_key(self, parent_key: bytes, block_token_ids: Sequence[int]) -> bytes:
        return self.hash_function(parent_key + pack_tokens(block_token_ids))

    def keys(
        self, scope_digest: bytes, token_ids: Sequence[int], private_from: Optional[PrivateFrom] = None
    ) -> list[bytes]:
        """Keys of every full block of `token_ids`, in one pass."""
        return self.extend([], scope_digest, token_ids, private_from)

    def extend(
        self,
        keys: list[bytes],
        scope_digest: bytes,
        token_ids: Sequence[int],
        private_from: Optional[PrivateFrom] = None,
    ) -> list[bytes]:
        """Append keys for blocks of `token_ids` that became full since `keys` was computed.

        `keys` must be the keys of a prefix of `token_ids` (as decode appends
        tokens, call this after each step); it is extended in place and returned.

        `private_from` = (block index, private scope digest) re-scopes the chain
        from that block on: blocks before it are keyed in the public scope (an
        operator-declared shared system prompt every tenant may reuse), blocks
        from it on also commit to the tenant's scope, so the chain forks there:

            public scope ─ p0 ─ p1 ─┬─ H(p1 ‖ tenant A scope) ─ a2 ─ ...
                                    └─ H(p1 ‖ tenant B scope) ─ b2 ─ ...
        """
        size = self.block_size
        hash_function = self.hash_function
        parent = keys[-1] if keys else scope_digest
        for start in range(len(keys) * size, len(token_ids) - size + 1, size):
            if private_from is not None and start == private_from[0] * size:
                parent = hash_function(parent + private_from[1])
            parent = hash_function(parent + pack_tokens(token_ids[start : start + size]))
            keys.append(parent)
        return keys
