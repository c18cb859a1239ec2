"""The two Ray Serve deployments of `build_app`: engine replicas, and the ingress that reads and places requests.

EngineReplica holds one engine and the app `prefixserve serve` runs, answering requests the ingress
forwards (asgi_call.py), its cache info (to compute routing keys) and its routing stats (the keys it
holds and its queue: replica_views.py). Ingress sits behind Serve's HTTP proxy: it reads a body,
tokenizes its prompt as the replicas will (router.inbound), works out the prompt's block keys
(router.route_keys), and sends the request through its handle, whose request router is ours.

A replica that goes away (its node lost, its actor dead) before the response could be read is the
ingress's to handle: the request goes to another replica, the failed one ranked last, until
REPLICA_GONE_SECONDS pass. A JSON answer is read whole before the client gets it, so such a
failure never reaches the client; a stream is committed at its first chunk, and if its replica
goes away after that, it ends with an error event (the client knows the answer is cut short).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Optional

from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..cache.scoping import compose_salt
from ..http_keys import AmbiguousAuthorization, KeyTable, credentials_of, load_api_keys
from ..router.forward import PREFILL_DROPPED_FIELDS
from ..router.inbound import MESSAGES_PATH, BadRequest, read_request
from ..router.route_keys import RouteKeys
from .app_args import serve_parser
from .asgi_call import ForwardedRequest, ResponseStart, call_asgi
from .replica_views import RouteEstimate, pack_keys

logger = logging.getLogger("prefixserve.ray")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", MESSAGES_PATH)
REPLICA_GONE_SECONDS = 60.0  # how long a request keeps trying other replicas while replicas go away
RETRY_PAUSE_SECONDS = 0.25
SCOPE_REFRESH_SECONDS = 10.0  # the replicas' scope is read again this often (a replica may have reloaded)
DEFAULT_MAX_MODEL_LEN = 32768  # until a replica says its own
HOP_HEADERS = (b"content-length", b"transfer-encoding", b"connection")


class EngineReplica:
    """One engine and its HTTP app, without a socket: Serve's proxy and the ingress stand in front."""

    def __init__(self, serve_argv: tuple) -> None:
        from ..server.serve_launch import build_server, check_model_dir  # here: the ingress process needs no engine

        args = serve_parser().parse_args(list(serve_argv))
        if args.model is not None:
            check_model_dir(args.model)
        self.engine, self.app = build_server(args)

    async def handle(self, request: ForwardedRequest):
        async for piece in call_asgi(self.app, request):
            yield piece

    def cache_info(self) -> dict:
        from ..server.admin import cache_info_body

        return cache_info_body(self.app.state.server)

    def record_routing_stats(self) -> dict:
        """The keys its pool and its own tiers hold (8-byte prefixes) and its queue, for every router."""
        cached = self.engine.queries.cached_keys()
        usage = self.engine.snapshot.usage
        return {
            "cache_keys": pack_keys(cached.pool),
            "tier_keys": {medium: pack_keys(keys) for medium, keys in cached.tiers.items()},
            "num_requests_waiting": self.engine.num_waiting,
            "num_requests_running": self.engine.snapshot.num_running,
            "kv_cache_usage": usage.usage,
        }

    def check_health(self) -> None:
        if self.engine.is_dead:
            raise RuntimeError("the engine thread stopped; Serve restarts this replica")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class Ingress:
    """Reads each request, prices it for the router, and relays the replica's answer."""

    def __init__(self, engine, serve_argv: tuple, prefill=None, local_prefill_tokens: int = 0) -> None:
        from ..model.default import (
            default_tokenizer_dir,  # the tokenizer only: no torch, no weights
        )
        from ..model.tokenizers.tokenizer import Tokenizer

        args = serve_parser().parse_args(list(serve_argv))
        self.engine = engine
        self.prefill = prefill  # the prefill deployment's handle under P/D, else None
        self.local_prefill_tokens = local_prefill_tokens
        self.keys = KeyTable(load_api_keys(args.api_keys_file, args.api_key))
        try:
            self.tokenizer: Optional[Tokenizer] = Tokenizer.from_dir(args.model or default_tokenizer_dir())
        except (OSError, ValueError) as error:  # a GGUF file, or a model only the replicas' nodes hold
            logger.warning("no tokenizer for %s here (%s): requests are routed by load only", args.model, error)
            self.tokenizer = None
        self.route_keys: Optional[RouteKeys] = None
        self.max_model_len = DEFAULT_MAX_MODEL_LEN
        self.default_max_tokens = 256
        self._scope_read_at = float("-inf")

    async def _learn_scope(self) -> None:
        if time.monotonic() - self._scope_read_at < SCOPE_REFRESH_SECONDS or self.tokenizer is None:
            return
        self._scope_read_at = time.monotonic()
        try:
            info = await self.engine.cache_info.remote()
            if info["tokenizer_fingerprint"] != self.tokenizer.fingerprint:
                logger.warning("the replicas use another tokenizer than model= gives here: routed by load only")
                return
            self.route_keys = RouteKeys.of(info)
            self.max_model_len = info.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
            self.default_max_tokens = info.get("default_max_tokens") or self.default_max_tokens
        except (RayActorError, KeyError, TypeError, ValueError) as error:
            logger.warning("could not read the replicas' cache info (%r): routed by load until it can", error)

    def _estimate(self, raw: bytes, path: str, headers) -> Optional[RouteEstimate]:
        """The request's keys and size (off the event loop); None when it cannot be read (the replica says why)."""
        if self.tokenizer is None:
            return None
        try:
            credentials = credentials_of(headers)
            client = read_request(
                raw, path, self.tokenizer, self.max_model_len, self.max_model_len * self.tokenizer.max_chars_per_token
            )
        except (AmbiguousAuthorization, BadRequest):
            return None
        tenant = self.keys.tenant_of(credentials)
        cache_salt = client.body.get("cache_salt")
        salt = compose_salt(tenant, cache_salt if isinstance(cache_salt, str) else None)
        route = (
            self.route_keys.route_request(client.token_ids, salt, client.model_name)
            if self.route_keys is not None
            else None
        )
        return RouteEstimate(route, (client.max_tokens or self.default_max_tokens) * client.num_choices)

    async def __call__(self, request: Request) -> Response:
        raw = await request.body()
        path = request.scope["path"]
        estimate = None
        if request.method == "POST" and path in ROUTED_PATHS:
            await self._learn_scope()
            estimate = await asyncio.to_thread(self._estimate, raw, path, request.headers)
        forwarded = ForwardedRequest(
            request.method, path, request.scope.get("query_string", b""), list(request.scope["headers"]), raw, estimate
        )
        if (
            self.prefill is not None
            and estimate is not None
            and estimate.route is not None
            and len(estimate.route.token_ids) > self.local_prefill_tokens
        ):
            await self._prefill(forwarded)
        return await self._relay(forwarded)

    async def _prefill(self, forwarded: ForwardedRequest) -> None:
        """P/D: the prompt computed on a prefill replica first (placed by its cached prefix and queue), which
        writes its KV to the shared tier before it answers; the engine replica then fetches what it lacks. One
        token, whole, the answer dropped. Best effort: if it fails, the engine replica computes the prompt."""
        try:
            body = json.loads(forwarded.body)
        except ValueError:
            return
        body = {key: value for key, value in body.items() if key not in PREFILL_DROPPED_FIELDS}
        raw = json.dumps({**body, "max_tokens": 1}).encode()
        headers = [(name, value) for name, value in forwarded.headers if name.lower() != b"content-length"]
        estimate = RouteEstimate(forwarded.route.route, 1)
        request = ForwardedRequest(forwarded.method, forwarded.path, forwarded.query, headers, raw, estimate)
        try:
            stream = self.prefill.handle.options(stream=True).remote(request)
            async for _ in stream:
                pass
        except RayActorError as failure:
            logger.warning(
                "a prefill replica went away (%s): the engine replica computes the prompt", type(failure).__name__
            )

    async def _relay(self, forwarded: ForwardedRequest) -> Response:
        """The answer of the first replica that gives one; a replica that goes away first is tried last."""
        deadline = time.monotonic() + REPLICA_GONE_SECONDS
        while True:
            forwarded.routed_to = None
            stream = self.engine.handle.options(stream=True).remote(forwarded)
            try:
                start, pieces = await _read_until_committed(stream)
            except RayActorError as failure:
                if forwarded.routed_to is not None:
                    forwarded.avoid.add(forwarded.routed_to)
                if time.monotonic() > deadline:
                    return JSONResponse(
                        {
                            "error": {
                                "message": f"no replica could answer: {failure}",
                                "type": "service_unavailable",
                                "code": "replicas_unavailable",
                            }
                        },
                        status_code=503,
                        headers={"retry-after": "1"},
                    )
                logger.warning(
                    "replica %s went away before answering (%s); trying another",
                    forwarded.routed_to,
                    type(failure).__name__,
                )
                await asyncio.sleep(RETRY_PAUSE_SECONDS)
                continue
            break
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in start.headers
            if name.lower() not in HOP_HEADERS
        }
        if not _is_stream(start):
            return Response(b"".join(pieces), status_code=start.status, headers=headers)
        return StreamingResponse(
            _rest_of_stream(pieces, stream, forwarded.path), status_code=start.status, headers=headers
        )


def _is_stream(start: ResponseStart) -> bool:
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream") for name, value in start.headers
    )


async def _read_until_committed(stream) -> tuple[ResponseStart, list[bytes]]:
    """The response's start and what may still be retried: a JSON body whole, a stream up to its first chunk."""
    start = await stream.__anext__()
    pieces: list[bytes] = []
    if _is_stream(start):
        async for piece in stream:
            pieces.append(piece)
            break
    else:
        pieces = [piece async for piece in stream]
    return start, pieces


async def _rest_of_stream(pieces: list[bytes], stream, path: str):
    for piece in pieces:
        yield piece
    try:
        async for piece in stream:
            yield piece
    except RayActorError as failure:
        logger.warning(
            "a stream's replica went away mid-answer (%s): the stream ends with an error event", type(failure).__name__
        )
        message = "the replica serving this stream went away; send the request again"
        if path == MESSAGES_PATH:  # Anthropic's stream error event
            body = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
            yield f"event: error\ndata: {json.dumps(body)}\n\n".encode()
        else:
            body = {"error": {"message": message, "type": "service_unavailable", "code": "replica_lost"}}
            yield f"data: {json.dumps(body)}\n\n".encode()
