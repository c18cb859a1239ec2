"""The OpenAI-compatible HTTP API over AsyncLLMEngine (FastAPI): wiring only.

Every error a client can cause comes back as an OpenAI-style body
{"error": {"message", "type", "param", "code"}} with a 4xx status (errors.py);
bodies are limited in size before they are read (http_body.BodySizeLimit); prompts
are tokenized off the event loop (inputs.py), so no request can stall another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from fastapi import APIRouter, Depends, FastAPI

from ..config import CACHE_RETENTIONS, DEFAULT_MAX_CACHE_TTL
from ..engine.async_engine import AsyncLLMEngine
from ..http_body import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit
from .admin import admin_routes
from .anthropic_routes import anthropic_routes
from .auth import Authenticator, admin_only, metrics_readers_only
from .dashboard.dashboard_routes import dashboard_api_routes, dashboard_routes
from .dashboard.recorder import DashboardMetrics, TenantContext
from .dashboard.whatif import whatif_routes
from .errors import install_error_handlers
from .inputs import RequestBuilder
from .lora_modules import LoRAModules
from .lora_routes import lora_routes
from .pin_routes import pin_routes
from .reload_routes import ReloadGate, reload_routes
from .response_routes import response_routes
from .response_store import DEFAULT_MAX_STORED, DEFAULT_TTL, ResponseStore
from .responses import TokenTexts
from .routes import metrics_routes, routes
from .tokenize import tokenize_routes
from .tool_calls import PARSERS
from .vllm_metrics import cache_config_info


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str = "prefixserve-tiny"
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant; empty: no auth
    admin_api_key: Optional[str] = None  # the operator's key for /v1/kv_events and /v1/cache/*; None: those are off
    metrics_api_key: Optional[str] = None  # a scraper's key: /metrics only, which needs one where tenants have keys
    max_waiting: int = 256  # waiting requests past which new ones get 429
    retry_after_seconds: int = 1
    default_max_tokens: int = 256  # when a request gives none (capped by the room its prompt leaves)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_cache_ttl: float = DEFAULT_MAX_CACHE_TTL  # seconds: the longest cache_ttl a request or tenant gets
    tenant_cache_ttls: Mapping[str, float] = field(default_factory=dict)  # tenant -> default cache_ttl
    # tenant -> "device" | "none" (privacy mode): its KV never leaves device memory / is never kept
    tenant_cache_retentions: Mapping[str, str] = field(default_factory=dict)
    tool_call_parser: str = "auto"  # how tool calls are read from output: auto (the template's), hermes, llama3_json
    responses_max_stored: int = DEFAULT_MAX_STORED  # stored Responses API responses past which the oldest goes
    responses_ttl: float = DEFAULT_TTL  # seconds a stored response is kept after its last use
    # LoRA adapters served by name (--lora-modules, and the admin's load/unload routes): a model name each
    lora_modules: LoRAModules = field(default_factory=LoRAModules)

    def __post_init__(self) -> None:
        """Every bad value named by its flag, before the model loads (launch.check_options builds one)."""
        if (
            not isinstance(self.served_model_name, str)
            or not self.served_model_name.strip()
            or "@" in self.served_model_name
        ):
            raise ValueError(
                f"served_model_name (--served-model-name) must be a non-empty name without '@' "
                f"('@' starts a version pin, NAME@fp_...), got {self.served_model_name!r}"
            )
        for name, flag, low in (
            ("max_waiting", "--max-waiting", 0),
            ("retry_after_seconds", None, 0),
            ("default_max_tokens", None, 1),
            ("max_request_bytes", "--max-request-bytes", 1),
            ("responses_max_stored", "--responses-max-stored", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                where = f"{name} ({flag})" if flag else name
                raise ValueError(f"{where} must be an integer >= {low}, got {value!r}")
        for name, flag in (("max_cache_ttl", "--max-cache-ttl"), ("responses_ttl", "--responses-ttl")):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} ({flag}) must be a positive number of seconds, got {value!r}")
        for tenant, ttl in self.tenant_cache_ttls.items():  # above max_cache_ttl is capped per request
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (math.isfinite(ttl) and ttl > 0):
                raise ValueError(f"tenant {tenant!r}: cache_ttl must be a positive number of seconds, got {ttl!r}")
        if self.tool_call_parser not in ("auto",) + PARSERS:
            raise ValueError(
                f"tool_call_parser (--tool-call-parser) must be one of auto, {', '.join(PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        for name, flag, holder in (
            ("admin_api_key", "--admin-api-key", "the operator"),
            ("metrics_api_key", "--metrics-api-key", "the scraper"),
        ):
            if getattr(self, name) is not None and getattr(self, name) in self.api_keys:
                raise ValueError(f"{name} ({flag}) is also a tenant key; give {holder} a key of its own")
        for lora in self.lora_modules.requests():
            if lora.lora_name == self.served_model_name or "@" in lora.lora_name:
                raise ValueError(
                    f"--lora-modules name {lora.lora_name!r} must differ from the served model's name and hold "
                    "no '@' (a version pin)"
                )
        for tenant, retention in self.tenant_cache_retentions.items():
            if retention not in CACHE_RETENTIONS:
                raise ValueError(
                    f"tenant {tenant!r}: cache_retention must be one of {', '.join(CACHE_RETENTIONS)}, "
                    f"got {retention!r}"
                )


@dataclass
class ServerState:
    """What the routes share: built once per app."""

    settings: ServerSettings
    engine: AsyncLLMEngine
    auth: Authenticator
    builder: RequestBuilder
    metrics: DashboardMetrics  # ServerMetrics plus what the dashboard shows (TTFT by hit/miss, tenants)
    responses: ResponseStore  # stored Responses API responses, each its tenant's own
    reload_gate: ReloadGate = field(default_factory=ReloadGate)
    _texts: Optional[TokenTexts] = field(default=None, init=False, repr=False)

    @property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs, of the served version's tokenizer (a reload swaps the version)."""
        tokenizer = self.engine.queries.version.tokenizer
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        return self._texts


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="prefixserve", version="0.1.0")
    state = ServerState(
        settings=settings,
        engine=engine,
        auth=Authenticator(settings.api_keys, settings.admin_api_key, settings.metrics_api_key),
        builder=RequestBuilder(engine, settings.default_max_tokens),
        responses=ResponseStore(settings.responses_max_stored, settings.responses_ttl),
        metrics=DashboardMetrics(
            lambda: engine.snapshot, settings.served_model_name, cache_config_info(engine.queries)
        ),
    )
    app.state.server = state
    app.state.engine = engine
    app.state.metrics = state.metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(TenantContext)  # outermost: the tenant of each request's key, for the dashboard
    for group in OPEN_ROUTE_GROUPS:
        app.include_router(group)
    app.include_router(metrics_router())
    app.include_router(admin_router())
    return app


OPEN_ROUTE_GROUPS = (
    routes,
    response_routes,
    anthropic_routes,
    tokenize_routes,
    dashboard_routes,
)  # a tenant's key (or none, with auth off)
ADMIN_ROUTE_GROUPS = (admin_routes, reload_routes, pin_routes, lora_routes, dashboard_api_routes, whatif_routes)
METRICS_ROUTE_GROUPS = (metrics_routes,)  # open without tenant keys; else the admin or the metrics key


def metrics_router() -> APIRouter:
    """/metrics, mounted under one dependency: where tenants have keys, its counters (each tenant's prompt and
    hit sizes, summed) answer the operator's admin or metrics key only, checked before the handler runs."""
    guarded = APIRouter(dependencies=[Depends(metrics_readers_only)])
    for group in METRICS_ROUTE_GROUPS:
        guarded.include_router(group)
    return guarded


def admin_router() -> APIRouter:
    """Every operator route (KV events, cache keys and stats, pins, reload, the dashboard's data), mounted
    under one dependency: the admin key is checked before a handler or its parameters are looked at, and
    a handler cannot skip it (tests/test_server_admin_guard.py checks every route of these groups)."""
    guarded = APIRouter(dependencies=[Depends(admin_only)])
    for group in ADMIN_ROUTE_GROUPS:
        guarded.include_router(group)
    return guarded
