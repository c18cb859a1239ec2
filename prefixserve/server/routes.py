"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..cache.scoping import compose_salt
from ..engine.async_engine import EngineDeadError
from ..http import error_response
from .errors import APIError
from .generation import collect, engine_dead, stream_response
from .inputs import completion_prompts, read_body, sampling_params
from .protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from .responses import ChatShape, CompletionShape, usage_of


def openai_routes(state) -> APIRouter:
    """`state` is the app's ServerState: settings, engine, auth, builder, metrics, token texts."""
    routes = APIRouter()
    settings, engine, metrics = state.settings, state.engine, state.metrics

    def check_model(name) -> None:
        if name is not None and name != settings.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {settings.served_model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def check_batch(num_requests: int) -> None:
        if num_requests > settings.max_waiting:
            raise APIError(400, f"this request asks for {num_requests} generations (prompts x n) but the server queues "
                                f"at most {settings.max_waiting}; split it into smaller requests",
                           param="n", code="batch_too_large")

    def start(requests):
        """Queue the requests now, or answer 429 when the queue is full; returns their output streams."""
        if engine.num_waiting + len(requests) > settings.max_waiting:
            metrics.num_rejected[0] += 1
            raise APIError(429, f"the server is busy ({engine.num_waiting} requests waiting); retry shortly",
                           "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_seconds)})
        try:
            return [engine.add(request) for request in requests]
        except EngineDeadError as error:
            raise engine_dead(error) from None

    def shape_kwargs(body) -> dict:
        return {"return_token_ids": body.return_token_ids, "num_logprobs": body.num_logprobs}

    def include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    @routes.post("/v1/completions")
    async def completions(request: Request):
        tenant = state.auth.tenant(request)
        body: CompletionRequest = await read_body(request, CompletionRequest)
        check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported; drop one of them",
                           param="echo", code="unsupported")
        prompts = completion_prompts(body.prompt)
        check_batch(len(prompts) * body.n)
        params = sampling_params(body, body.num_logprobs)
        requests = await state.builder.build(prompts, params, body.requested_max_tokens, body.n,
                                             compose_salt(tenant, body.cache_salt))
        shape = CompletionShape(new_id("cmpl"), now(), settings.served_model_name, state.texts, echo=body.echo,
                                **shape_kwargs(body))
        streams = start(requests)
        if body.stream:
            usage = include_usage(body)
            return stream_response(streams, shape, metrics,
                                   lambda finals: shape.usage_chunk(usage_of(finals, body.n)) if usage else None)
        finals = await collect(request, streams, metrics)
        return shape.response(finals, usage_of(finals, body.n))

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = state.auth.tenant(request)
        body: ChatCompletionRequest = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        check_batch(body.n)
        prompt_ids = await state.builder.chat_prompt(body)
        params = sampling_params(body, body.num_logprobs)
        requests = await state.builder.build([prompt_ids], params, body.requested_max_tokens, body.n,
                                             compose_salt(tenant, body.cache_salt))
        shape = ChatShape(new_id("chatcmpl"), now(), settings.served_model_name, state.texts, **shape_kwargs(body))
        streams = start(requests)
        if body.stream:
            usage = include_usage(body)
            role_chunks = [shape.role_chunk(i, prompt_ids) for i in range(body.n)]
            return stream_response(streams, shape, metrics,
                                   lambda finals: shape.usage_chunk(usage_of(finals, body.n)) if usage else None,
                                   role_chunks)
        finals = await collect(request, streams, metrics)
        return shape.response(finals, usage_of(finals, body.n))

    @routes.get("/v1/models")
    async def models(request: Request):
        state.auth.tenant(request)
        return {"object": "list", "data": [{"id": settings.served_model_name, "object": "model", "created": now(),
                                            "owned_by": "prefixserve", "max_model_len": state.builder.max_model_len}]}

    @routes.get("/health")
    async def health():
        if engine.is_dead:
            return error_response(503, "the engine loop stopped; restart the server", "server_error",
                                  code="engine_dead")
        return {"status": "ok"}

    @routes.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return routes
