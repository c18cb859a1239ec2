"""Who is asking: a tenant (its key picks the cache scope) or the operator (the admin key).

Tenant keys and the admin key are separate: endpoints that reveal cache state
(KV events, block keys, scope) answer only the admin key, never a tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping, Optional

from fastapi import Request

from ..http import KeyTable, bearer_token
from .errors import APIError


class Authenticator:
    def __init__(self, api_keys: Mapping[str, str], admin_api_key: Optional[str] = None) -> None:
        if admin_api_key is not None and admin_api_key in api_keys:
            raise ValueError("the admin API key is also a tenant key; give the operator a key of its own")
        self.tenants = KeyTable(api_keys)
        self._admin_digest = hashlib.sha256(admin_api_key.encode()).digest() if admin_api_key else None

    def tenant(self, request: Request) -> Optional[str]:
        """The tenant of the request's API key (None when no keys are configured: auth is off)."""
        if not self.tenants:
            return None
        tenant = self.tenants.lookup(bearer_token(request.headers.get("authorization")))
        if tenant is None:
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        return tenant

    def require_admin(self, request: Request) -> None:
        """Admit the operator's key only; these endpoints are off when no admin key is configured."""
        if self._admin_digest is None:
            raise APIError(404, "this endpoint is off; start the server with --admin-api-key to enable it",
                           "not_found_error", code="admin_disabled")
        key = bearer_token(request.headers.get("authorization"))
        if not key:
            raise APIError(401, "this endpoint needs the admin API key; send 'Authorization: Bearer <admin key>'",
                           "authentication_error", code="invalid_api_key")
        if not hmac.compare_digest(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest(), self._admin_digest):
            raise APIError(403, "this endpoint needs the operator's admin API key, not a tenant key",
                           "permission_error", code="admin_only")
