"""Who is asking: a tenant (its key picks the cache scope) or the operator (the admin key, or the metrics key).

Tenant keys and the operator's keys are separate: endpoints that reveal cache state
(KV events, block keys, scope) answer only the admin key, never a tenant's; where
tenants have keys, /metrics answers the admin key or the metrics key (a scraper's).
"""

from __future__ import annotations

from typing import Mapping, Optional

from fastapi import Request

from ..http import APIError
from ..http_keys import AdminKey, AmbiguousAuthorization, KeyTable, MetricsReaders, credentials_of


class Authenticator:
    def __init__(
        self, api_keys: Mapping[str, str], admin_api_key: Optional[str] = None, metrics_api_key: Optional[str] = None
    ) -> None:
        if admin_api_key is not None and admin_api_key in api_keys:
            raise ValueError("the admin API key is also a tenant key; give the operator a key of its own")
        if metrics_api_key is not None and metrics_api_key in api_keys:
            raise ValueError("the metrics API key is also a tenant key; give the scraper a key of its own")
        self.tenants = KeyTable(api_keys)
        self.admin = AdminKey(admin_api_key, "server")
        self.metrics_readers = MetricsReaders(self.tenants, self.admin, metrics_api_key)

    def tenant(self, request: Request) -> Optional[str]:
        """The tenant of the request's API key (None when no keys are configured: auth is off). The key is
        x-api-key's (Anthropic's header) or the Bearer token: the same keys, the same tenants."""
        try:
            credentials = credentials_of(request.headers)
        except AmbiguousAuthorization as error:
            raise APIError(400, str(error), code="ambiguous_authorization") from None
        if not self.tenants:
            return None
        tenant = self.tenants.tenant_of(credentials)
        if tenant is None:
            raise APIError(
                401,
                "missing or invalid API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "authentication_error",
                code="invalid_api_key",
            )
        return tenant

    def require_admin(self, request: Request) -> None:
        """Admit the operator's key only; these endpoints are off when no admin key is configured."""
        self.admin.require(request.headers, self.tenants)


async def admin_only(request: Request) -> None:
    """The one dependency every operator route is mounted under (api.admin_router): a handler never calls
    the check itself, so a route added to an admin group cannot forget it."""
    request.app.state.server.auth.require_admin(request)


async def metrics_readers_only(request: Request) -> None:
    """The dependency /metrics is mounted under (api.metrics_router): open without tenant keys, else the
    admin or the metrics key (MetricsReaders)."""
    request.app.state.server.auth.metrics_readers.require(request.headers)
