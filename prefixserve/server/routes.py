"""The OpenAI endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health; and /metrics (its own group).

Routes are plain functions over the app's ServerState (`request.app.state.server`), so
each helper can be called and tested alone.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.async_engine import EngineDeadError
from ..http import APIError, error_response, split_model
from .beats import beating_response, wants_beats
from .generation import collect, engine_dead, stream_response
from .inputs import cache_options, completion_prompts, read_body, sampling_params
from .protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from .reasoning import thinking_of
from .responses import ChatShape, CompletionShape, usage_of
from .tool_prompt import parser_for, tool_grammar

routes = APIRouter()
metrics_routes = APIRouter()  # /metrics: mounted under the metrics readers' guard (api.metrics_router)


def server_state(request: Request):
    """The app's ServerState: settings, engine, auth, builder, metrics, token texts."""
    return request.app.state.server


def check_model(settings, model) -> None:
    """The served model's name, optionally with a version (checked by `check_version`)."""
    if model is None:
        return
    try:
        name, _ = split_model(model)
    except ValueError as error:
        raise APIError(400, str(error), param="model", code="invalid_value") from None
    if name != settings.served_model_name and settings.lora_modules.request_for(name) is None:
        adapters = "".join(f", {lora.lora_name!r}" for lora in settings.lora_modules.requests())
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {settings.served_model_name!r}{adapters}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )


def answering_model(settings, model) -> str:
    """The `model` a response names, as vLLM's do: the adapter's name where the request asked for one (checked by
    check_model), else the served model's."""
    name = split_model(model)[0] if model is not None else None
    adapter = name is not None and settings.lora_modules.request_for(name) is not None
    return name if adapter else settings.served_model_name


def check_version(state, model) -> None:
    """A request pinned to a model version ('name@fp_...') runs only on that version; call it inside the
    reload gate, where the version cannot change before the request is queued."""
    version = split_model(model)[1] if model is not None else None
    fingerprint = state.engine.queries.version.scope.model_fingerprint
    if version is not None and not fingerprint.startswith(version):
        raise APIError(
            404,
            f"model {model!r}: this server serves version fp_{fingerprint[:16]} of "
            f"{state.settings.served_model_name!r}, not {version}; ask for "
            f"{state.settings.served_model_name!r} to take any version",
            "not_found_error",
            param="model",
            code="model_not_found",
        )


def check_batch(settings, num_requests: int) -> None:
    if num_requests > settings.max_waiting:
        raise APIError(
            400,
            f"this request asks for {num_requests} generations (prompts x n) but the server queues "
            f"at most {settings.max_waiting}; split it into smaller requests",
            param="n",
            code="batch_too_large",
        )


def with_tool_choice(params, body, parser: str, schema_field: str = "function.parameters"):
    """The params with tool_choice's grammar ("required" or a named function); a 400 beside another constraint."""
    grammar = tool_grammar(body.tools, body.tool_choice, body.parallel_tool_calls, parser, schema_field)
    if grammar is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(
            400,
            "tool_choice forces a tool call, which response_format (or guided_*) would constrain too; send one of them",
            param="tool_choice",
            code="invalid_value",
        )
    return replace(params, structured_outputs=grammar)


def start(state, requests) -> list:
    """Queue the requests now, or answer 429 when the queue is full; returns their output streams."""
    engine, settings = state.engine, state.settings
    if engine.num_waiting + len(requests) > settings.max_waiting:
        state.metrics.num_rejected[0] += 1
        raise APIError(
            429,
            f"the server is busy ({engine.num_waiting} requests waiting); retry shortly",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(settings.retry_after_seconds)},
        )
    try:
        return [engine.add(request) for request in requests]
    except EngineDeadError as error:
        raise engine_dead(error) from None


async def respond(request: Request, state, body, shape, streams, first_chunks=()):
    """Stream the outputs as SSE, or collect them into one response body; with progress beats if asked."""
    beats = wants_beats(request)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def closing(finals):
            return shape.usage_chunk(usage_of(finals, body.n)) if include_usage else None

        return stream_response(
            streams, shape, state.metrics, closing, first_chunks, beats_of=state.engine if beats else None
        )

    async def whole() -> dict:
        finals = await collect(None if beats else request, streams, state.metrics)
        return shape.response(finals, usage_of(finals, body.n))

    return beating_response(whole, state.engine) if beats else await whole()


async def accept(request: Request, model: type):
    """(state, tenant, body) of an authenticated request for the served model, its body read strictly."""
    state = server_state(request)
    tenant = state.auth.tenant(request)
    body = await read_body(request, model)
    check_model(state.settings, body.model)
    return state, tenant, body


def shape_options(state, body) -> dict:
    """Response options; the fingerprint is read inside the reload gate: the version that will serve."""
    return {
        "return_token_ids": body.return_token_ids,
        "num_logprobs": body.num_logprobs,
        "system_fingerprint": "fp_" + state.engine.queries.version.scope.model_fingerprint[:16],
    }


@routes.post("/v1/completions")
async def completions(request: Request):
    state, tenant, body = await accept(request, CompletionRequest)
    if body.echo and body.logprobs is not None:
        raise APIError(
            400,
            "echo with logprobs (prompt logprobs) is not supported; drop one of them",
            param="echo",
            code="unsupported",
        )
    prompts = completion_prompts(body.prompt)
    check_batch(state.settings, len(prompts) * body.n)
    async with state.reload_gate.admitting():  # tokenized and queued on one model version
        check_version(state, body.model)
        requests = await state.builder.build(
            prompts,
            sampling_params(body, body.num_logprobs),
            body.requested_max_tokens,
            body.n,
            cache_options(state.settings, tenant, body),
        )
        shape = CompletionShape(
            new_id("cmpl"),
            now(),
            answering_model(state.settings, body.model),
            state.texts,
            echo=body.echo,
            **shape_options(state, body),
        )
        streams = start(state, requests)
    return await respond(request, state, body, shape, streams)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state, tenant, body = await accept(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    check_batch(state.settings, body.n)
    async with state.reload_gate.admitting():  # tokenized and queued on one model version
        check_version(state, body.model)
        template = state.builder.tokenizer.chat_template
        thinking, reads_reasoning = thinking_of(
            template, body.reasoning_effort, state.settings.served_model_name, "reasoning_effort"
        )
        prompt_ids = await state.builder.chat_prompt(body, thinking)
        parser = parser_for(template, state.settings.tool_call_parser)
        params = with_tool_choice(sampling_params(body, body.num_logprobs), body, parser)
        requests = await state.builder.build(
            [prompt_ids], params, body.requested_max_tokens, body.n, cache_options(state.settings, tenant, body)
        )
        reads_calls = bool(body.tools) and body.tool_choice != "none"
        shape = ChatShape(
            new_id("chatcmpl"),
            now(),
            answering_model(state.settings, body.model),
            state.texts,
            tool_parser=parser if reads_calls else None,
            max_calls=1 if body.parallel_tool_calls is False else None,
            reasoning=reads_reasoning,
            **shape_options(state, body),
        )
        streams = start(state, requests)
    role_chunks = [shape.role_chunk(i, prompt_ids) for i in range(body.n)] if body.stream else ()
    return await respond(request, state, body, shape, streams, role_chunks)


def _adapter_card(state, lora) -> dict:
    """A LoRA adapter as vLLM lists one: its own model id, the base as its parent, its path as its root."""
    return {
        **_model_card(state),
        "id": lora.lora_name,
        "root": lora.lora_path,
        "parent": state.settings.served_model_name,
    }


def _model_card(state) -> dict:
    return {
        "id": state.settings.served_model_name,
        "object": "model",
        "created": now(),
        "owned_by": "prefixserve",
        "max_model_len": state.builder.max_model_len,
    }


@routes.get("/v1/models")
async def models(request: Request):
    state = server_state(request)
    state.auth.tenant(request)
    adapters = [_adapter_card(state, lora) for lora in state.settings.lora_modules.requests()]
    return {"object": "list", "data": [_model_card(state), *adapters]}


@routes.get("/v1/models/{model:path}")
async def model(request: Request, model: str):
    """One model (the SDK's models.retrieve): the served one, also by a version pin (name@fp_...)."""
    state = server_state(request)
    state.auth.tenant(request)
    check_model(state.settings, model)
    check_version(state, model)
    lora = state.settings.lora_modules.request_for(split_model(model)[0])
    return _model_card(state) if lora is None else _adapter_card(state, lora)


@routes.get("/health")
async def health(request: Request):
    if server_state(request).engine.is_dead:
        return error_response(503, "the engine loop stopped; restart the server", "server_error", code="engine_dead")
    return {"status": "ok"}


@metrics_routes.get("/metrics")
async def prometheus_metrics(request: Request):
    return Response(generate_latest(server_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
