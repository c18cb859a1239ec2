"""The HTTP router: an OpenAI-compatible front door for replicas started with `prefixserve serve`.

It tokenizes each request with the replicas' tokenizer, chat template and
scope, so its block keys equal theirs; asks the routing policy which replica
should serve it (kv_aware: the one that holds the longest prefix, unless that
one is overloaded); and passes the request through, streaming included. A
replica that fails or times out is taken out and a non-streamed request is
retried on another, so none is lost; health checks bring it back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Mapping, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from ..cache import BlockKeyer, CacheScope
from ..cache.scoping import PromptScoper, compose_salt
from .costs import CostModel, policy_options_for
from .policies import RouteRequest, make_policy
from .replicas import Replica

logger = logging.getLogger("prefixserve.router")
FORWARDED_HEADERS = ("authorization", "content-type")


@dataclass(frozen=True)
class RouterSettings:
    replicas: tuple[str, ...]
    policy: str = "kv_aware"
    model: Optional[str] = None  # checkpoint directory whose tokenizer the replicas use; None: built-in
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant, as the replicas have it
    cost: CostModel = field(default_factory=CostModel)
    health_interval: float = 1.0
    sync_interval: float = 0.2
    request_timeout: float = 600.0
    control_timeout: float = 2.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL")


def error(status: int, message: str, type_: str = "invalid_request_error", code: Optional[str] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}}, status_code=status)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["replica"]
        self.routed = Counter("prefixserve_router:routed_requests", "Requests routed to each replica.", labels,
                              registry=self.registry)
        self.predicted_hits = Counter("prefixserve_router:predicted_hit_tokens", "Prompt tokens predicted cached on "
                                      "the chosen replica.", labels, registry=self.registry)
        self.failovers = Counter("prefixserve_router:failovers", "Requests moved off a failed replica.", labels,
                                 registry=self.registry)
        self.load = Gauge("prefixserve_router:replica_load_seconds", "Estimated outstanding work.", labels,
                          registry=self.registry)
        self.healthy = Gauge("prefixserve_router:replica_healthy", "1 when the replica passes health checks.", labels,
                             registry=self.registry)


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        from ..model import Tokenizer, ensure_default_model  # tokenizer only: no weights are loaded

        self.settings = settings
        self.replicas = [Replica(url) for url in settings.replicas]
        self.policy = make_policy(settings.policy, policy_options_for(settings.cost))
        self.tokenizer = Tokenizer.from_dir(settings.model or ensure_default_model())
        self.metrics = RouterMetrics()
        self.scoper: Optional[PromptScoper] = None  # learned from the first replica that answers
        self.keyer: Optional[BlockKeyer] = None
        self.client = httpx.AsyncClient(timeout=settings.request_timeout)
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------- background
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._sync_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(r.check_health(self.client, self.settings.control_timeout) for r in self.replicas))
            if self.scoper is None:
                await self._learn_scope()
            await asyncio.sleep(self.settings.health_interval)

    async def _sync_loop(self) -> None:
        while True:
            headers = self._control_headers()
            await asyncio.gather(*(r.sync(self.client, headers, self.settings.control_timeout) for r in self.replicas))
            await asyncio.sleep(self.settings.sync_interval)

    def _control_headers(self) -> dict:
        key = next(iter(self.settings.api_keys), None)
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _learn_scope(self) -> None:
        """Take the scope and block size from a replica; refuse one whose tokenizer differs from ours."""
        for replica in self.replicas:
            if not replica.healthy:
                continue
            try:
                response = await self.client.get(replica.url + "/v1/cache/info", headers=self._control_headers(),
                                                 timeout=self.settings.control_timeout)
                info = response.json()
            except (httpx.HTTPError, ValueError) as failure:
                replica.mark_down(f"cache info failed ({failure!r})")
                continue
            if info["tokenizer_fingerprint"] != self.tokenizer.fingerprint:
                logger.error("replica %s uses another tokenizer than the router's --model; its keys would never "
                             "match: start the router with the replicas' --model", replica.url)
                continue
            scoper = PromptScoper(CacheScope(info["model_fingerprint"], info["tokenizer_fingerprint"],
                                             info["adapter_id"]), info["block_size"])
            for prefix in info["shared_prefixes"]:
                scoper.declare_shared_prefix(prefix)
            self.keyer = BlockKeyer(info["block_size"], info["prefix_hash"])
            self.scoper = scoper
            return

    # ---------------------------------------------------------------- routing
    def route_request(self, token_ids: list[int], salt: Optional[str]) -> Optional[RouteRequest]:
        if self.scoper is None or not token_ids:
            return None
        scope_digest, private_from = self.scoper.scope_for(token_ids, salt)
        keys = self.keyer.keys(scope_digest, token_ids, private_from)
        size = self.keyer.block_size
        return RouteRequest(keys, token_ids, scope_digest, -(-len(token_ids) // size), size)

    def choose(self, route: Optional[RouteRequest], exclude: set[int]) -> Optional[int]:
        candidates = [i for i, r in enumerate(self.replicas) if r.healthy and i not in exclude]
        if not candidates:
            return None
        if route is None:
            return min(candidates, key=lambda i: self.replicas[i].load)
        chosen = self.policy.choose(route, [self.replicas[i] for i in candidates])
        return candidates[chosen]

    def prompt_tokens(self, path: str, body: dict) -> list[int]:
        """The token ids the replica will see (the first prompt of a batch decides its placement)."""
        if path.endswith("/chat/completions"):
            messages = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in body.get("messages", [])]
            return self.tokenizer.encode_chat(messages)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return []

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            tenant = self._tenant(request)
            token_ids = self.prompt_tokens(path, body) if isinstance(body, dict) else []
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError):
            body, tenant, token_ids = None, None, []  # the replica answers with the precise error
        cache_salt = body.get("cache_salt") if isinstance(body, dict) else None
        route = self.route_request(token_ids, compose_salt(tenant, cache_salt if isinstance(cache_salt, str) else None))
        streaming = isinstance(body, dict) and bool(body.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[int] = set()
        while True:
            index = self.choose(route, tried)
            if index is None:
                return error(503, "no healthy replica can take the request; retry shortly", "server_error",
                             "no_replica")
            tried.add(index)
            replica = self.replicas[index]
            ticket = next(self._ids)
            self._record_route(replica, route, body, ticket)
            try:
                if streaming:
                    return await self._stream(replica, path, raw, headers, ticket)
                response = await self.client.post(replica.url + path, content=raw, headers=headers)
                if response.status_code >= 500:
                    raise httpx.HTTPStatusError("replica error", request=response.request, response=response)
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"),
                                headers=_passthrough(response.headers, replica))
            except httpx.HTTPError as failure:
                replica.outstanding.pop(ticket, None)
                replica.num_failures += 1
                self.metrics.failovers.labels(replica.name).inc()
                replica.mark_down(f"request failed ({failure!r})")
            finally:
                if not streaming:
                    replica.outstanding.pop(ticket, None)

    async def _stream(self, replica: Replica, path: str, raw: bytes, headers: dict, ticket: int) -> Response:
        upstream = await self.client.send(self.client.build_request("POST", replica.url + path, content=raw,
                                                                    headers=headers), stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            replica.outstanding.pop(ticket, None)
            if upstream.status_code >= 500:
                raise httpx.HTTPStatusError("replica error", request=upstream.request, response=upstream)
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"), headers=_passthrough(upstream.headers, replica))

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                replica.outstanding.pop(ticket, None)
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream", headers=_passthrough(upstream.headers, replica))

    def _record_route(self, replica: Replica, route: Optional[RouteRequest], body, ticket: int) -> None:
        cost = self.settings.cost
        max_tokens = (body.get("max_tokens") or body.get("max_completion_tokens") or 16) if isinstance(body, dict) else 16
        hit_tokens = 0
        prompt_tokens = 0
        if route is not None:
            hit_tokens = replica.num_hit_blocks(route) * route.tokens_per_block
            prompt_tokens = len(route.token_ids)
            # Optimistic: the replica is about to cache this prompt's full blocks.
            replica.mirror.keys.update(route.keys)
        replica.outstanding[ticket] = (cost.prefill_seconds(prompt_tokens, min(hit_tokens, prompt_tokens))
                                       + cost.decode_work_seconds(int(max_tokens)))
        replica.num_routed += 1
        replica.num_predicted_hit_tokens += hit_tokens
        self.metrics.routed.labels(replica.name).inc()
        self.metrics.predicted_hits.labels(replica.name).inc(hit_tokens)

    def _tenant(self, request: Request) -> Optional[str]:
        if not self.settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        return self.settings.api_keys.get(header[7:].strip()) if header.lower().startswith("bearer ") else None

    def refresh_gauges(self) -> None:
        for replica in self.replicas:
            self.metrics.load.labels(replica.name).set(replica.load)
            self.metrics.healthy.labels(replica.name).set(1.0 if replica.healthy else 0.0)


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content or ""


def _passthrough(headers: httpx.Headers, replica: Replica) -> dict:
    kept = {k: v for k, v in headers.items() if k.lower() in ("retry-after",)}
    kept["x-prefixserve-replica"] = replica.url
    return kept


def build_router_app(settings: RouterSettings) -> FastAPI:
    router = Router(settings)

    @asynccontextmanager
    async def lifespan(_app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="prefixserve router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        for replica in router.replicas:
            if replica.healthy:
                try:
                    response = await router.client.get(replica.url + "/v1/models", timeout=settings.control_timeout,
                                                       headers={k: v for k, v in request.headers.items()
                                                                if k.lower() == "authorization"})
                    return Response(response.content, status_code=response.status_code,
                                    media_type="application/json")
                except httpx.HTTPError as failure:
                    replica.mark_down(f"models failed ({failure!r})")
        return error(503, "no healthy replica", "server_error", "no_replica")

    @app.get("/health")
    async def health():
        healthy = [r.url for r in router.replicas if r.healthy]
        if not healthy:
            return error(503, "no healthy replica", "server_error", "no_replica")
        return {"status": "ok", "healthy_replicas": healthy}

    @app.get("/metrics")
    async def metrics():
        router.refresh_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
