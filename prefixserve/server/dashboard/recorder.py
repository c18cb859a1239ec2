"""What the dashboard measures beyond the engine's counters: TTFT split by cache hit or miss, and per-tenant hits.

Both are observed where every finished request already passes (ServerMetrics.observe_finished).
The TTFT split is a Prometheus histogram in the server's own registry, so /metrics and the
dashboard read the same numbers. Per-tenant counts are not exported to /metrics (a scraper's key
reads it): only the admin-keyed snapshot shows them, by tenant id.

A finished output does not name its tenant, so `TenantContext` (ASGI middleware) notes the
tenant of each HTTP request's API key (x-api-key's or its Bearer token, as the handlers read it)
in a context variable that the handlers' tasks inherit.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import Histogram
from starlette.datastructures import Headers

from ...http_keys import AmbiguousAuthorization, credentials_of
from ...metric_names import TTFT_BY_CACHE
from ..metrics import LATENCY_BUCKETS, ServerMetrics

NO_KEY = "(no key)"  # requests on a server without API keys
current_tenant: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("prefixserve_tenant", default=None)


@dataclass
class TenantCounts:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class DashboardMetrics(ServerMetrics):
    """ServerMetrics plus TTFT by cache hit/miss (in /metrics) and per-tenant hit counts (dashboard only)."""

    def __init__(self, snapshot: Callable, model_name: str, cache_info: dict[str, str]) -> None:
        super().__init__(snapshot, model_name, cache_info)
        self.ttft_by_cache = Histogram(
            TTFT_BY_CACHE,
            "Time to first token, by whether the prompt reused cached blocks.",
            ["cache"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        for outcome in ("hit", "miss"):
            self.ttft_by_cache.labels(outcome)  # both series exist from the start
        self.tenants: dict[str, TenantCounts] = {}

    def observe_finished(self, output) -> None:
        super().observe_finished(output)
        metrics = output.metrics
        if metrics is not None and metrics.ttft is not None:
            self.ttft_by_cache.labels("hit" if output.num_cached_tokens else "miss").observe(metrics.ttft)
        counts = self.tenants.setdefault(current_tenant.get() or NO_KEY, TenantCounts())
        counts.num_requests += 1
        counts.num_prompt_tokens += len(output.prompt_token_ids)
        counts.num_cached_tokens += output.num_cached_tokens


class TenantContext:
    """ASGI middleware: the tenant of the request's API key, in `current_tenant`, for the request's lifetime.

    Add it last (outermost), so every task that serves the request inherits the value.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = None
        state = getattr(scope.get("app"), "state", None)
        server = getattr(state, "server", None)
        if server is not None and server.auth.tenants:
            try:
                tenant = server.auth.tenants.tenant_of(credentials_of(Headers(scope=scope)))
            except AmbiguousAuthorization:
                pass  # the handler answers 400: the request is never counted
        token = current_tenant.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)
