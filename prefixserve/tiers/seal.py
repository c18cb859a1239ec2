"""Who may write a record a tier hands back: the fleet's secret, its key ids and rotation, the seal.

A tier is a trust boundary: whoever can write Redis, or a cache directory, could
otherwise plant KV that changes another replica's answers. With a secret every
record is sealed, and a reader accepts only records sealed under a secret it holds:

    seal 1  AES-256-GMAC: a 16-byte tag over the whole record (header and payload),
            which stays readable (a Redis dump shows token ids and KV)
    seal 2  AES-256-GCM: token ids and KV encrypted, the header authenticated; the
            key also commits to the tenant's scope, so one tenant's records open
            under no other tenant's key

Each record gets a random 16-byte salt, and its key is HKDF-SHA-256(secret, salt,
purpose [+ tenant scope]): no key seals two records, so GCM's fixed nonce is safe
however many records the fleet writes. Why GMAC rather than HMAC-SHA-256 or keyed
BLAKE2b: on the Sapphire Rapids Xeon of this round, over 64 KiB to 1 MiB records,
HMAC-SHA-256 runs at 2.0 GB/s, keyed BLAKE2b at 1.1 GB/s, CRC-32 at 5.9 GB/s,
AES-256-GCM at 12 GB/s and GMAC over associated data at 40 GB/s (AES-NI, VAES and
carry-less multiply; benchmarks/tier_seal.py). A 2,000-token SmolLM2 prefix is
92 MB of float32 KV: 46 ms under HMAC alone. A sealed record skips the payload CRC
(the tag finds damage too), so encode + decode of a sealed record runs at 4.8 GB/s
against 2.4 GB/s unsealed (copies included; docs/tiers.md, "The tiers are a trust boundary").

The secret file holds one secret per line; the first seals, later ones are still
accepted until the time each states (a rolling change of secret):

    # prefixserve KV tier secrets
    6f1c...e2   (at least 32 characters; `python -c "import secrets; print(secrets.token_hex(32))"`)
    91ab...07 until=2026-12-09T00:00:00Z

A record names its secret by a key id, the first 8 bytes of HMAC-SHA-256(secret,
"prefixserve key id"), which reveals nothing of the secret.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger("prefixserve.tiers")

UNSEALED, GMAC, GCM = 0, 1, 2
SEALS = (UNSEALED, GMAC, GCM)
KEY_ID_SIZE = 8
SALT_SIZE = 16
TAG_SIZE = 16
MIN_SECRET_CHARS = 32
_NONCE = bytes(12)  # every key seals one record only
_PURPOSE = {GMAC: b"prefixserve kv record v2 gmac", GCM: b"prefixserve kv record v2 gcm tenant "}
_FIX = 'make one with `python -c "import secrets; print(secrets.token_hex(32))" > FILE`'


class SealError(ValueError):
    """A record whose seal cannot be verified (unknown or expired key id, wrong tag, wrong tenant)."""


@dataclass(frozen=True)
class Secret:
    key_id: bytes
    value: bytes
    accept_until: Optional[float]  # time.time() after which records under it are refused; None: the sealing one


def key_id_of(secret: bytes) -> bytes:
    return hmac.digest(secret, b"prefixserve key id", "sha256")[:KEY_ID_SIZE]


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF with SHA-256 (extract, then expand)."""
    prk = hmac.digest(salt, secret, "sha256")
    blocks, block = [], b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        blocks.append(block)
    return b"".join(blocks)[:length]


class Keyring:
    """The secrets a replica seals and verifies records with: the first seals, all unexpired verify."""

    def __init__(self, secrets_: Sequence[Secret], source: str = "") -> None:
        if not secrets_ or secrets_[0].accept_until is not None:
            raise ValueError("a keyring needs a sealing secret first (one without until=)")
        self.secrets = tuple(secrets_)
        self.source = source
        self._by_id = {secret.key_id: secret for secret in self.secrets}
        if len(self._by_id) != len(self.secrets):
            raise ValueError(f"{source or 'the keyring'}: the same secret appears twice")

    @classmethod
    def from_secret(cls, secret: Union[str, bytes]) -> "Keyring":
        value = secret.encode() if isinstance(secret, str) else bytes(secret)
        _check_secret(value, "the secret")
        return cls([Secret(key_id_of(value), value, None)])

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "Keyring":
        """Parse a secret file (module docstring); ValueError names what is wrong and how to fix it."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"kv_tier_secret_file {path}: cannot read it ({error}); {_FIX}") from None
        if mode & 0o077:
            logger.warning(
                "kv_tier_secret_file %s is readable by other users (mode %o): chmod 600 it", path, mode & 0o777
            )
        found: list[Secret] = []
        now = time.time()
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            value, _, option = line.partition(" ")
            where = f"kv_tier_secret_file {path}, line {number}"
            _check_secret(value.encode(), where)
            until = _parse_until(option.strip(), where) if option.strip() else None
            if not found and until is not None:
                raise ValueError(
                    f"{where}: the first secret seals new records and takes no until=; put the "
                    "secret being rolled in first and the old one after it with until="
                )
            if found and until is None:
                raise ValueError(
                    f"{where}: a secret after the first is only accepted for a window; add "
                    "until=YYYY-MM-DDTHH:MM:SSZ (when every replica seals with the new one)"
                )
            if until is not None and until <= now:
                logger.info("%s: expired at %s, no longer accepted", where, option.strip())
                continue
            found.append(Secret(key_id_of(value.encode()), value.encode(), until))
        if not found:
            raise ValueError(f"kv_tier_secret_file {path} holds no secret; {_FIX}")
        return cls(found, str(path))

    @property
    def sealing(self) -> Secret:
        return self.secrets[0]

    def find(self, key_id: bytes) -> Optional[Secret]:
        """The secret under `key_id`, None when unknown or past its window."""
        secret = self._by_id.get(bytes(key_id))
        if secret is None or (secret.accept_until is not None and time.time() > secret.accept_until):
            return None
        return secret


class Sealer:
    """Seals records on their way into a tier and verifies them on their way out (record.py calls it)."""

    def __init__(self, keyring: Keyring, encrypt: bool = False) -> None:
        self.keyring = keyring
        self.seal = GCM if encrypt else GMAC

    def new_salt(self) -> bytes:
        return secrets.token_bytes(SALT_SIZE)

    def tag(self, salt: bytes, header, payload) -> bytes:
        """GMAC seal: a 16-byte tag over header and payload under the sealing secret (streamed: no copy)."""
        encryptor = _gcm(_key(self.keyring.sealing.value, GMAC, salt, b"")).encryptor()
        encryptor.authenticate_additional_data(header)
        encryptor.authenticate_additional_data(payload)
        encryptor.finalize()
        return encryptor.tag

    def encrypt(self, salt: bytes, tenant_scope: bytes, header, plaintext) -> bytes:
        """GCM seal: the ciphertext followed by its 16-byte tag."""
        return AESGCM(_key(self.keyring.sealing.value, GCM, salt, tenant_scope)).encrypt(_NONCE, plaintext, header)

    def open(self, seal: int, key_id: bytes, salt: bytes, tenant_scope: bytes, header, sealed, tag) -> Optional[bytes]:
        """Verify a sealed record; for GCM decrypt too and return the plaintext (`sealed` and `tag` must then be
        adjacent: `sealed` is the ciphertext and tag). Raises SealError."""
        secret = self.keyring.find(key_id)
        if secret is None:
            raise SealError(
                f"sealed under key id {bytes(key_id).hex()}, which this replica does not hold (or whose "
                "until= window has passed): give every replica the same kv_tier_secret_file"
            )
        key = _key(secret.value, seal, salt, tenant_scope)
        try:
            if seal == GMAC:
                decryptor = _gcm(key, bytes(tag)).decryptor()
                decryptor.authenticate_additional_data(header)
                decryptor.authenticate_additional_data(sealed)
                decryptor.finalize()
                return None
            return AESGCM(key).decrypt(_NONCE, sealed, header)
        except InvalidTag:
            raise SealError("the seal does not match: forged, altered, or another tenant's record") from None


def _key(secret: bytes, seal: int, salt: bytes, tenant_scope: bytes) -> bytes:
    return hkdf_sha256(secret, salt, _PURPOSE[seal] + (tenant_scope if seal == GCM else b""))


def _gcm(key: bytes, tag: Optional[bytes] = None) -> Cipher:
    return Cipher(algorithms.AES(key), modes.GCM(_NONCE, tag))


def _check_secret(value: bytes, where: str) -> None:
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{where}: a secret needs at least {MIN_SECRET_CHARS} characters, got {len(value)}; {_FIX}")


def _parse_until(option: str, where: str) -> float:
    name, _, value = option.partition("=")
    if name != "until" or not value:
        raise ValueError(f"{where}: expected until=YYYY-MM-DDTHH:MM:SSZ after the secret, got {option!r}")
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{where}: until={value!r} is not an ISO 8601 time like 2026-12-09T00:00:00Z") from None
    if moment.tzinfo is None:
        raise ValueError(f"{where}: until={value!r} needs a time zone (end it with Z for UTC)")
    return moment.timestamp()
