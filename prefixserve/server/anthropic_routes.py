"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and POST /v1/messages/count_tokens.

Auth as on the OpenAI endpoints (x-api-key or a Bearer key, mapped to tenants alike); every error is
Anthropic's body. The prefix up to each cache_control breakpoint is pinned for its TTL once the request has
computed it (engine/operations/pins.py's keep: a later request with the same breakpoint pushes the expiry out), so it
stays in the pool, and so in every tier below, for at least that long.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..anthropic_chat import anthropic_error_body
from ..chat_tools import render_chat, template_reads_tools
from ..engine.async_engine import EngineDeadError
from ..engine.sampling_params import SamplingParams
from ..engine.structured_output import StructuredOutputs
from ..http import BEATS, PROGRESS_HEADER, APIError
from .anthropic_protocol import MessagesCreate, MessagesRequest
from .anthropic_render import common_prefix, conversation_of, tool_choice_of
from .anthropic_responses import MessageStream, anthropic_error, error_event, message_body
from .beats import SSE_BEAT, beating, beating_response, wants_beats
from .generation import collect
from .inputs import cache_options, read_body
from .routes import check_model, check_version, server_state, start
from .tool_prompt import parser_for, tool_grammar

logger = logging.getLogger("prefixserve")
anthropic_routes = APIRouter()


async def _encode(state, conversation, messages, generation_prompt: bool) -> list[int]:
    tokenizer = state.builder.tokenizer
    try:
        rendered, tools = render_chat(
            messages, conversation.tool_dicts(), template_reads_tools(tokenizer.chat_template)
        )
    except ValueError as error:
        raise APIError(400, str(error), param="messages") from None
    state.builder.check_text_size(sum(len(m["content"]) for m in rendered) + len(str(tools or "")), "messages")
    try:
        return await asyncio.to_thread(tokenizer.encode_chat, rendered, generation_prompt, tools)
    except Exception as error:  # a template may reject a conversation (e.g. role order)
        raise APIError(400, f"the chat template rejected these messages: {error}", param="messages") from None


async def _breakpoints(state, conversation, prompt_ids: list[int]) -> list[tuple[int, float]]:
    """(prompt tokens up to the breakpoint, ttl) of each cache_control breakpoint."""
    places = []
    for messages, ttl in conversation.cuts:
        try:
            ids = await _encode(state, conversation, messages, False)
        except APIError:  # a template that cannot render the conversation cut there: that breakpoint keeps nothing
            ids = []
        places.append((common_prefix(ids, prompt_ids), min(ttl, state.settings.max_cache_ttl)))
    return places


async def _keep(state, prompt_ids: list[int], places, options) -> None:
    block_size = state.engine.queries.block_size
    for place, ttl in places:
        if place < block_size:
            continue
        try:
            await state.engine.call(
                lambda core, p=place, t=ttl: core.keep_prefix(prompt_ids[:p], options.tenant, options.salt, t)
            )
        except ValueError as error:  # the pool too busy, or the pin cap reached: the prefix stays cached as usual
            logger.debug("cache_control breakpoint at %d tokens not pinned: %s", place, error)


def _params(body: MessagesCreate) -> SamplingParams:
    """Sampling fields (temperature, top_p, top_k: older clients send them; the SDK's extra_body does too) and
    output_config.format's schema."""
    output_format = body.output_config.format if body.output_config is not None else None
    try:
        structured = StructuredOutputs(json=output_format.json_schema) if output_format is not None else None
        return SamplingParams(
            max_tokens=None,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            stop=body.stop_sequences,
            structured_outputs=structured,
        )
    except ValueError as error:
        raise APIError(400, f"output_config: {error}" if output_format is not None else str(error)) from None


async def _create(request: Request):
    state = server_state(request)
    tenant = state.auth.tenant(request)
    body = await read_body(request, MessagesCreate)
    check_model(state.settings, body.model)
    conversation = conversation_of(body)
    tool_choice, parallel = tool_choice_of(body)
    parser = parser_for(state.builder.tokenizer.chat_template, state.settings.tool_call_parser)
    params = _params(body)
    grammar = tool_grammar(conversation.tools, tool_choice, parallel, parser, schema_field="input_schema")
    if grammar is not None and params.structured_outputs is not None:
        raise APIError(
            400, "tool_choice forces a tool call, which output_config.format would constrain too; send one of them"
        )
    params = params if grammar is None else replace(params, structured_outputs=grammar)
    options = cache_options(state.settings, tenant, body)
    async with state.reload_gate.admitting():
        check_version(state, body.model)
        prompt_ids = await _encode(state, conversation, conversation.messages, True)
        places = await _breakpoints(state, conversation, prompt_ids)
        requests = await state.builder.build([prompt_ids], params, body.max_tokens, 1, options)
        streams = start(state, requests)
    reads_calls = parser if conversation.tools and tool_choice != "none" else None
    max_calls = 1 if parallel is False else None  # disable_parallel_tool_use
    cache_until = max((place for place, _ in places), default=0)
    message_id, beats = f"msg_{uuid.uuid4().hex[:24]}", wants_beats(request)  # a router asks for beats (beats.py)
    if body.stream:
        shape = MessageStream(message_id, body.model, reads_calls, cache_until, max_calls)
        events = _events(state, streams[0], shape, lambda: _keep(state, prompt_ids, places, options))
        if beats:
            return StreamingResponse(
                beating(events, state.engine, SSE_BEAT),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", PROGRESS_HEADER: BEATS},
            )
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def whole() -> dict:
        finals = await collect(None if beats else request, streams, state.metrics)
        await _keep(state, prompt_ids, places, options)
        return message_body(message_id, body.model, finals[0], reads_calls, cache_until, max_calls)

    return beating_response(whole, state.engine, _error_body) if beats else await whole()


def _error_body(error: APIError) -> dict:
    return anthropic_error_body(error.status, error.message)


async def _events(state, stream: AsyncIterator, shape: MessageStream, keep) -> AsyncIterator[str]:
    try:
        async for out in stream:
            if out.finished and out.finish_reason == "error":
                yield error_event(500, f"{out.error or 'the request failed'}; the server log has the details")
                return
            for text in shape.events(out):
                yield text
            if out.finished:
                state.metrics.observe_finished(out)
                await keep()
    except EngineDeadError as error:
        yield error_event(503, str(error))
    finally:
        await stream.aclose()


@anthropic_routes.post("/v1/messages")
async def create_message(request: Request):
    try:
        return await _create(request)
    except APIError as error:
        return anthropic_error(error.status, error.message, error.headers)


@anthropic_routes.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    try:
        state = server_state(request)
        state.auth.tenant(request)
        body = await read_body(request, MessagesRequest)
        check_model(state.settings, body.model)
        conversation = conversation_of(body)
        return {"input_tokens": len(await _encode(state, conversation, conversation.messages, True))}
    except APIError as error:
        return anthropic_error(error.status, error.message, error.headers)
