"""API keys the server and the router share: a request's key headers, tenant keys, the operator's keys, the keys file.

Both front doors face hostile clients, so both compare keys in constant time (as
SHA-256 digests) and read a request's key the same way: x-api-key's (Anthropic's
header), else the Authorization header's Bearer token (`Credentials.key`), for a
tenant and for the operator alike.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Mapping, NamedTuple, Optional

from .cache.tenant_shares import SHARE_FIELDS, Share, share_from
from .config import CACHE_RETENTIONS
from .http import APIError


class AmbiguousAuthorization(ValueError):
    """More than one Authorization header: which one counts would differ between a router and a replica."""


def authorization_of(headers) -> Optional[str]:
    """The request's one Authorization header (Starlette's Headers), None when absent; more than one is
    AmbiguousAuthorization (a 400): a replica reading the first and a router forwarding the last would
    disagree about who is asking."""
    values = headers.getlist("authorization")
    if len(values) > 1:
        raise AmbiguousAuthorization(f"the request has {len(values)} Authorization headers; send exactly one")
    return values[0] if values else None


class Credentials(NamedTuple):
    """What a request shows of who it is: its one Authorization header and its one x-api-key (Anthropic's)."""

    authorization: Optional[str]
    api_key: Optional[str]

    @property
    def key(self) -> str:
        """The tenant key: x-api-key's, else the Bearer token ('' when neither)."""
        return self.api_key if self.api_key is not None else bearer_token(self.authorization)

    def headers(self) -> dict:
        """The headers to forward them in, byte for byte as the client sent them."""
        headers = {}
        if self.authorization is not None:
            headers["authorization"] = raw_header(self.authorization)
        if self.api_key is not None:
            headers["x-api-key"] = raw_header(self.api_key)
        return headers


def credentials_of(headers) -> Credentials:
    """A request's key headers (Starlette's Headers); AmbiguousAuthorization (a 400) for two of either, or an
    x-api-key beside a Bearer key that differs: server and router would not agree on who is asking."""
    authorization = authorization_of(headers)
    api_keys = headers.getlist("x-api-key")
    if len(api_keys) > 1 or (api_keys and authorization is not None and bearer_token(authorization) != api_keys[0]):
        raise AmbiguousAuthorization("send one API key: one x-api-key header, or Authorization: Bearer, not both")
    return Credentials(authorization, api_keys[0] if api_keys else None)


def raw_header(value: str) -> bytes:
    """A header value as the client sent its bytes (Starlette decodes them as latin-1), to forward as is."""
    return value.encode("latin-1")


def bearer_token(authorization: Optional[str]) -> str:
    """The key of an `Authorization: Bearer <key>` header ('' when absent or malformed)."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return ""
    return authorization[7:].strip()


class KeyTable:
    """API key -> tenant, looked up in constant time: every stored key is compared, none short-circuits.

    Keys are compared as SHA-256 digests, so the comparison time depends neither on
    where a guess first differs nor on its length.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._entries = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> Optional[str]:
        digest = _digest(key)
        found = None
        for stored, tenant in self._entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def tenant_of(self, credentials: Credentials) -> Optional[str]:
        """The tenant of a request's key, x-api-key's or its Bearer token (None: no key, or an unknown one).
        The one way server, router and dashboard tell who is asking."""
        return self.lookup(credentials.key)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _credentials_or_400(headers) -> Credentials:
    try:
        return credentials_of(headers)
    except AmbiguousAuthorization as error:
        raise APIError(400, str(error), code="ambiguous_authorization") from None


def _raise(refusal: Optional["Refusal"]) -> None:
    if refusal is not None:
        raise APIError(refusal.status, refusal.message, refusal.type, code=refusal.code)


class Refusal(NamedTuple):
    """Why a request may not read an operator endpoint, as the error to answer."""

    status: int
    message: str
    type: str
    code: str


class OperatorKey:
    """One of the operator's keys (admin, metrics), compared in constant time as a SHA-256 digest."""

    def __init__(self, key: Optional[str]) -> None:
        self._digest = _digest(key) if key else None

    @property
    def is_configured(self) -> bool:
        return self._digest is not None

    def matches(self, key: str) -> bool:
        """Whether `key` is this key (constant time; never when none is configured)."""
        return self._digest is not None and hmac.compare_digest(_digest(key), self._digest)


class AdminKey:
    """The operator's key (server or router), compared in constant time as a SHA-256 digest.

    Endpoints that reveal cache or fleet state answer it only: without one configured they are
    off (404), a missing key is 401, any other key (a tenant's) 403. It is read as a tenant's
    key is (`Credentials.key`), so an operator on Anthropic's SDK sends it as x-api-key.
    """

    def __init__(self, key: Optional[str], owner: str) -> None:
        self.key = OperatorKey(key)
        self.owner = owner  # "server" or "router": where --admin-api-key is given

    def require(self, headers, tenants: Optional[KeyTable] = None) -> None:
        """Raise APIError unless the request (Starlette's Headers) carries the admin key: 400 for two keys,
        else `refusal`'s answer. The server's and the router's guard."""
        _raise(self.refusal(_credentials_or_400(headers), tenants))

    def refusal(self, credentials: Credentials, tenants: Optional[KeyTable] = None) -> Optional[Refusal]:
        """None when `credentials` carry the admin key; else why not, as an error to answer: 401 for
        a missing or unknown key, 403 for a tenant's key (one of `tenants`)."""
        if not self.key.is_configured:
            return Refusal(
                404,
                f"this endpoint is off; start the {self.owner} with --admin-api-key to enable it",
                "not_found_error",
                "admin_disabled",
            )
        key = credentials.key
        if not key:
            return Refusal(
                401,
                "this endpoint needs the admin API key; send 'Authorization: Bearer <admin key>' "
                "or 'x-api-key: <admin key>'",
                "authentication_error",
                "invalid_api_key",
            )
        if not self.key.matches(key):
            if tenants is not None and tenants.lookup(key) is not None:
                return Refusal(
                    403,
                    "this endpoint needs the operator's admin API key, not a tenant key",
                    "permission_error",
                    "admin_only",
                )
            return Refusal(
                401,
                "this endpoint needs the admin API key; the key sent is not it",
                "authentication_error",
                "invalid_api_key",
            )
        return None


class MetricsReaders:
    """Who may read /metrics: anyone where there are no tenant keys (as before); where there are, the operator's
    admin key or its metrics key (--metrics-api-key, for a Prometheus scraper: it opens /metrics only).

    The prefix-cache counters rise by each request's prompt and hit sizes, so a tenant reading them
    between its own requests would learn what another tenant sends and shares, with no clock needed.
    Without an admin or a metrics key configured, a keyed /metrics is off (404), as admin endpoints are;
    a missing or unknown key is 401, a tenant's key 403. Both operator keys are compared on every read.
    """

    def __init__(self, tenants: KeyTable, admin: AdminKey, metrics_key: Optional[str]) -> None:
        self.tenants = tenants
        self.owner = admin.owner
        self.admin_key, self.metrics_key = admin.key, OperatorKey(metrics_key)

    @property
    def is_open(self) -> bool:
        return not self.tenants

    def require(self, headers) -> None:
        """Raise APIError unless the request may read /metrics (Starlette's Headers): 400 for two keys, else
        `refusal`'s answer. The server's and the router's guard."""
        if self.is_open:
            return
        _raise(self.refusal(_credentials_or_400(headers)))

    def refusal(self, credentials: Credentials) -> Optional[Refusal]:
        if self.is_open:
            return None
        owner = self.owner
        if not (self.admin_key.is_configured or self.metrics_key.is_configured):
            return Refusal(
                404,
                f"/metrics is off on a {owner} with tenant API keys (its counters would show one tenant "
                f"another's traffic); start the {owner} with --metrics-api-key (a Prometheus scraper's key) "
                "or --admin-api-key, and send that key",
                "not_found_error",
                "metrics_disabled",
            )
        key = credentials.key
        if not key:
            return Refusal(
                401,
                f"/metrics needs the {owner}'s metrics or admin API key where tenants have keys; send "
                "'Authorization: Bearer <metrics key>' (Prometheus: authorization.credentials_file)",
                "authentication_error",
                "invalid_api_key",
            )
        is_admin, is_metrics = self.admin_key.matches(key), self.metrics_key.matches(key)  # both: no early exit
        if is_admin or is_metrics:
            return None
        if self.tenants.lookup(key) is not None:
            return Refusal(
                403,
                f"/metrics needs the {owner}'s metrics or admin API key, not a tenant key",
                "permission_error",
                "operator_only",
            )
        return Refusal(
            401,
            f"/metrics needs the {owner}'s metrics or admin API key; the key sent is neither",
            "authentication_error",
            "invalid_api_key",
        )


def is_valid_tenant_id(tenant: str) -> bool:
    """Printable, non-empty, at most 256 characters: no control characters (NUL, newlines) in tenant ids."""
    return 0 < len(tenant) <= 256 and tenant.isprintable()


class KeyEntry(NamedTuple):
    tenant: str
    cache_ttl: Optional[float]  # the tenant's default cache TTL (seconds); None: the server's
    cache_retention: Optional[str]  # "device" | "none": the tenant's KV never leaves the device / is never kept
    shares: Optional[dict] = None  # the share fields it gives (pin_share, min_kv_share, max_kv_share): fractions


ENTRY_FIELDS = ("tenant", "cache_ttl", "cache_retention", *SHARE_FIELDS)


def _read_keys_file(api_keys_file: str) -> dict[str, KeyEntry]:
    """key -> KeyEntry from a JSON object whose values are a tenant id or {"tenant": id, "cache_ttl":
    seconds, "cache_retention": "device" | "none", "pin_share" / "min_kv_share" / "max_kv_share": fractions}
    (all but the tenant optional; cache/tenant_shares.py says what the shares do)."""
    import math
    from pathlib import Path

    path = Path(api_keys_file)
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--api-keys-file {path}: cannot read a JSON object of key -> tenant ({error})") from None
    if not isinstance(loaded, dict):
        raise SystemExit(f"--api-keys-file {path}: expected a JSON object mapping API key strings to tenant names")
    entries: dict[str, KeyEntry] = {}
    for key, value in loaded.items():
        if not key:
            raise SystemExit(f"--api-keys-file {path}: an API key is empty; give every tenant a non-empty key")
        ttl = retention = shares = None
        if isinstance(value, dict):
            unknown = set(value) - set(ENTRY_FIELDS)
            if unknown or "tenant" not in value:
                raise SystemExit(
                    f"--api-keys-file {path}: a key's entry is a tenant name or an object with "
                    f"'tenant' and optional 'cache_ttl' (seconds), 'cache_retention' "
                    f"({' or '.join(CACHE_RETENTIONS)}) and {', '.join(map(repr, SHARE_FIELDS))} (fractions "
                    f"from 0 to 1); got fields {sorted(value)}"
                )
            shares = {name: value[name] for name in SHARE_FIELDS if name in value} or None
            if shares:
                try:
                    share_from(shares, Share(min_kv_share=0.0, max_kv_share=1.0), f"tenant {value['tenant']!r}")
                except ValueError as error:
                    raise SystemExit(f"--api-keys-file {path}: {error}") from None
            tenant, ttl, retention = value["tenant"], value.get("cache_ttl"), value.get("cache_retention")
            if ttl is not None and (
                isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0
            ):
                raise SystemExit(
                    f"--api-keys-file {path}: cache_ttl of tenant {tenant!r} must be a positive number "
                    f"of seconds, got {ttl!r}"
                )
            if retention is not None and retention not in CACHE_RETENTIONS:
                raise SystemExit(
                    f"--api-keys-file {path}: cache_retention of tenant {tenant!r} must be one of "
                    f"{list(CACHE_RETENTIONS)}, got {retention!r}"
                )
        else:
            tenant = value
        if not isinstance(tenant, str):
            raise SystemExit(f"--api-keys-file {path}: expected a JSON object mapping API key strings to tenant names")
        if not is_valid_tenant_id(tenant):
            raise SystemExit(
                f"--api-keys-file {path}: tenant id {tenant!r} must be 1 to 256 printable characters "
                "(no control characters such as NUL or newlines)"
            )
        entries[key] = KeyEntry(tenant, None if ttl is None else float(ttl), retention, shares)
    return entries


def load_api_keys(api_keys_file: Optional[str], api_key: Optional[str] = None) -> dict[str, str]:
    """key -> tenant from a JSON keys file, plus a single --api-key as tenant 'default'.

    Tenant ids must be printable (no NUL or other control characters), so that what a
    log or a metric shows is what the operator wrote.
    """
    keys = {key: entry.tenant for key, entry in _read_keys_file(api_keys_file).items()} if api_keys_file else {}
    if api_key:
        keys[api_key] = "default"
    return keys


def _tenant_settings(api_keys_file: Optional[str], field: str) -> dict:
    """tenant -> the keys-file entry's `field` (a KeyEntry field) for the tenants that give one; one value
    per tenant, whichever of its keys it is given under."""
    if not api_keys_file:
        return {}
    settings: dict = {}
    for entry in _read_keys_file(api_keys_file).values():
        value = getattr(entry, field)
        if value is not None and settings.setdefault(entry.tenant, value) != value:
            raise SystemExit(
                f"--api-keys-file {api_keys_file}: tenant {entry.tenant!r} has two different {field} "
                "values; give each tenant one"
            )
    return settings


def load_tenant_cache_ttls(api_keys_file: Optional[str]) -> dict[str, float]:
    """tenant -> default cache TTL (seconds) for the tenants whose keys-file entry gives one."""
    return _tenant_settings(api_keys_file, "cache_ttl")


def load_tenant_shares(api_keys_file: Optional[str]) -> dict[str, dict]:
    """tenant -> the share fields its keys-file entry gives (EngineConfig.tenant_shares' form)."""
    return _tenant_settings(api_keys_file, "shares")


def load_tenant_cache_retentions(api_keys_file: Optional[str]) -> dict[str, str]:
    """tenant -> cache_retention for the tenants whose keys-file entry gives one (privacy mode)."""
    return _tenant_settings(api_keys_file, "cache_retention")
