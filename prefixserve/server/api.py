"""The OpenAI-compatible HTTP API over AsyncLLMEngine (FastAPI).

Every error a client can cause comes back as an OpenAI-style body
{"error": {"message", "type", "param", "code"}} with a 4xx status; nothing
a client sends can crash the server or show it a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.events import event_to_dict
from ..cache.scoping import compose_salt
from ..engine.async_engine import AsyncLLMEngine
from ..engine.engine import PromptTooLongError
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, Usage, new_id, now
from .streams import merge_streams, sse

logger = logging.getLogger("prefixserve.server")
DISCONNECT_POLL_SECONDS = 0.25


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str = "prefixserve-tiny"
    api_keys: Mapping[str, str] = field(default_factory=dict)  # key -> tenant; empty: no auth
    max_waiting: int = 256  # waiting requests past which new ones get 429
    retry_after_seconds: int = 1
    default_max_tokens: int = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="prefixserve", version="0.1.0")
    metrics = ServerMetrics(engine.engine)
    app.state.engine = engine
    app.state.metrics = metrics

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def on_api_error(_, error: APIError):
        return error_response(error.status, error.message, error.type, error.param, error.code, error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), kind)

    @app.exception_handler(Exception)
    async def on_unexpected(_, error: Exception):
        logger.exception("unhandled error")
        return error_response(500, "internal server error; the server log has the details", "server_error")

    # ------------------------------------------------------------ helpers
    def authenticate(request: Request) -> Optional[str]:
        """The tenant of the request's API key (None when auth is off)."""
        if not settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if key not in settings.api_keys:
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        return settings.api_keys[key]

    async def parse(request: Request, model: type[BaseModel]):
        try:
            payload = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(payload)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            raise APIError(422, f"{param}: {first['msg']}", param=param, code="invalid_value") from None

    def check_model(name: Optional[str]) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {settings.served_model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def sampling_params(body: SamplingFields, max_tokens: Optional[int]) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens or settings.default_max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k in (None, 0) else body.top_k,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos,
            )
        except ValueError as error:
            raise APIError(400, str(error), code="invalid_value") from None

    def make_requests(prompts: list, params: SamplingParams, n: int, salt: Optional[str]):
        requests = []
        for prompt in prompts:
            for sample in range(n):
                try:
                    requests.append(engine.make_request(prompt, params.for_sample(sample), new_id("req"), salt))
                except PromptTooLongError as error:
                    raise APIError(413, str(error), param="prompt", code="context_length_exceeded") from None
                except (ValueError, TypeError) as error:
                    raise APIError(400, str(error), param="prompt", code="invalid_prompt") from None
        if engine.num_waiting + len(requests) > settings.max_waiting:
            metrics.num_rejected[0] += 1
            raise APIError(429, f"the server is busy ({engine.num_waiting} requests waiting); retry shortly",
                           "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_seconds)})
        return requests

    def usage_of(finals: list[RequestOutput], n: int) -> dict:
        """Usage of outputs in request order; the n samples of a prompt count its prompt once, as OpenAI does."""
        firsts = finals[::n]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in firsts)
        cached = sum(out.num_cached_tokens for out in firsts)
        completion = sum(len(out.token_ids) for out in finals)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                     prompt_tokens_details={"cached_tokens": cached}).model_dump()

    async def collect(request: Request, requests) -> list[RequestOutput]:
        """Run non-streamed requests to the end; a client that disconnects aborts them."""
        async def final(req):
            last = None
            async for last in engine.generate(req):
                pass
            metrics.observe_finished(last)
            return last

        task = asyncio.gather(*(final(req) for req in requests))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")

    def stream(requests, n: int, chunk, include_usage: bool, first_chunks=()) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            finals: list[Optional[RequestOutput]] = [None] * len(requests)
            for body in first_chunks:
                yield sse(body)
            async for index, out in merge_streams([engine.generate(req) for req in requests]):
                if out.delta_text or out.finished:
                    yield sse(chunk(index, out))
                if out.finished:
                    metrics.observe_finished(out)
                    finals[index] = out
            if include_usage:
                yield sse({**chunk(0, None), "usage": usage_of(finals, n)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health():
        if engine.is_dead:
            return error_response(503, "the engine loop stopped; restart the server", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authenticate(request)
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model", "created": now(),
                                            "owned_by": "prefixserve", "max_model_len": engine.engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv_events")
    async def kv_events(request: Request, since: int = 0):
        """KV events (BlockStored / BlockRemoved / AllBlocksCleared) numbered >= `since`, for routers.

        `complete: false` means some were already dropped: resync from /v1/cache/keys.
        """
        authenticate(request)
        queue = engine.engine.events
        if queue is None:
            raise APIError(404, "KV events are off; start the server with --enable-kv-events", "not_found_error")
        events, next_cursor, complete = queue.since(since)
        return {"events": [event_to_dict(e) for e in events], "next": next_cursor, "complete": complete}

    @app.get("/v1/cache/keys")
    async def cache_keys(request: Request):
        """Every cached block key (hex), read between engine steps, and the event cursor it is current to."""
        authenticate(request)

        def snapshot(core):
            cursor = core.events.next_seq if core.events is not None else None
            return [key.hex() for key in core.cache.keys()], cursor

        keys, cursor = await engine.call(snapshot)
        return {"keys": keys, "next": cursor}

    @app.get("/v1/cache/info")
    async def cache_info(request: Request):
        """What a router needs to compute the same block keys as this replica."""
        authenticate(request)
        core = engine.engine
        return {"model_fingerprint": core.scope.model_fingerprint,
                "tokenizer_fingerprint": core.scope.tokenizer_fingerprint,
                "adapter_id": core.scope.adapter_id, "block_size": core.config.block_size,
                "prefix_hash": core.config.prefix_hash, "shared_prefixes": core.scoper.shared_prefixes,
                "max_model_len": core.max_model_len, "served_model_name": settings.served_model_name}

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = authenticate(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        check_model(body.model)
        prompts = _completion_prompts(body.prompt)
        requests = make_requests(prompts, sampling_params(body, body.max_tokens), body.n, compose_salt(tenant, body.cache_salt))
        response_id, created, model = new_id("cmpl"), now(), settings.served_model_name

        def chunk(index, out):
            choices = [] if out is None else [{"index": index, "text": out.delta_text, "logprobs": None,
                                               "finish_reason": out.finish_reason if out.finished else None}]
            return {"id": response_id, "object": "text_completion", "created": created, "model": model,
                    "choices": choices}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return stream(requests, body.n, chunk, include_usage)
        finals = await collect(request, requests)
        choices = [{"index": i, "text": (out.prompt or "") * body.echo + out.text, "logprobs": None,
                    "finish_reason": out.finish_reason} for i, out in enumerate(finals)]
        return {"id": response_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage_of(finals, body.n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = authenticate(request)
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = engine.engine.tokenizer.encode_chat(messages)
        except Exception as error:  # a template may reject a conversation (e.g. role order)
            raise APIError(400, f"the chat template rejected these messages: {error}", param="messages") from None
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens)
        requests = make_requests([prompt_ids], params, body.n, compose_salt(tenant, body.cache_salt))
        response_id, created, model = new_id("chatcmpl"), now(), settings.served_model_name

        def chunk(index, out):
            choices = [] if out is None else [{"index": index, "delta": {"content": out.delta_text} if out.delta_text else {},
                                               "logprobs": None,
                                               "finish_reason": out.finish_reason if out.finished else None}]
            return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            role_chunks = [{"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}]} for i in range(body.n)]
            return stream(requests, body.n, chunk, include_usage, role_chunks)
        finals = await collect(request, requests)
        choices = [{"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                    "finish_reason": out.finish_reason} for i, out in enumerate(finals)]
        return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage_of(finals, body.n)}

    return app


def _completion_prompts(prompt) -> list:
    """A string, a list of strings, a list of token ids, or a list of token-id lists, as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; send a string, a list of strings or token ids", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return list(prompt)
