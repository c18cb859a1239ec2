"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

A request becomes the chat it is (response_render.py) and runs as /v1/chat/completions would (the same tool
grammar, structured output, cache options). With previous_response_id the stored turn's prompt and output
tokens are the new prompt's first tokens, exactly as computed, so the prefix cache holds everything through the
last turn's output; only the new input is prefilled (response_store.py).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Literal, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ..engine.async_engine import EngineDeadError
from ..http import APIError
from .errors import most_specific
from .generation import collect, engine_dead, request_failed
from .inputs import cache_options, read_body, sampling_params
from .protocol import ChatCompletionRequest
from .reasoning import thinking_of
from .response_objects import ResponseShape, item_id
from .response_protocol import UNSUPPORTED_RESPONSE_FIELDS, ResponsesCreate
from .response_render import assistant_message, chat_body, input_items, input_messages
from .response_store import StoredResponse
from .routes import answering_model, check_model, check_version, server_state, start, with_tool_choice
from .tool_prompt import parser_for

response_routes = APIRouter()

CHAT_TO_RESPONSES = {  # a field of the chat body this request became -> the field the client sent
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _as_chat(body: ResponsesCreate, history: list[dict]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(chat_body(body, history))
    except ValidationError as error:
        first = most_specific(error.errors())
        loc = [str(part) for part in first["loc"]]
        field = CHAT_TO_RESPONSES.get(loc[0], loc[0]) if loc else "input"
        param = ".".join([field, *loc[1:]])
        raise APIError(422, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


async def _prompt(
    state, chat: ChatCompletionRequest, previous: Optional[StoredResponse], thinking: dict
) -> tuple[str, list[int]]:
    """(rendered text, token ids) of the chat; after `previous`, its prompt and output tokens as they were."""
    tokenizer = state.engine.queries.version.tokenizer
    text = await state.builder.chat_text(chat, thinking, param="input", what="this conversation")
    if previous is not None and previous.tokenizer == tokenizer.fingerprint:
        done = previous.prompt_text + tokenizer.decode(previous.output_ids, skip_special_tokens=False)
        if text.startswith(done):
            rest = await asyncio.to_thread(tokenizer.encode, text[len(done) :], False)
            return text, previous.prompt_ids + previous.output_ids + rest
    return text, await asyncio.to_thread(tokenizer.encode, text, False)


def _echo(body: ResponsesCreate) -> dict:
    """What the response object repeats of the request."""
    return body.model_dump(
        include={
            "instructions",
            "max_output_tokens",
            "parallel_tool_calls",
            "previous_response_id",
            "temperature",
            "top_p",
            "tool_choice",
            "tools",
            "text",
            "reasoning",
            "store",
            "metadata",
        },
        exclude_none=True,
        by_alias=True,
    )


@response_routes.post("/v1/responses")
async def create_response(request: Request):
    state = server_state(request)
    tenant = state.auth.tenant(request)
    body = await read_body(request, ResponsesCreate, UNSUPPORTED_RESPONSE_FIELDS)
    check_model(state.settings, body.model)
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id, tenant, "previous_response_id")
    history = previous.messages if previous is not None else []
    chat = _as_chat(body, history)
    parser = parser_for(state.builder.tokenizer.chat_template, state.settings.tool_call_parser)
    async with state.reload_gate.admitting():  # rendered, tokenized and queued on one model version
        check_version(state, body.model)
        thinking, reads_reasoning = thinking_of(
            state.builder.tokenizer.chat_template,
            chat.reasoning_effort,
            state.settings.served_model_name,
            "reasoning.effort",
        )
        prompt_text, prompt_ids = await _prompt(state, chat, previous, thinking)
        try:
            params = with_tool_choice(sampling_params(chat, None), chat, parser, schema_field="parameters")
        except APIError as error:  # the chat's response_format is this request's text.format
            if error.param != "response_format":
                raise
            message = error.message.replace("response_format", "text.format", 1)
            raise APIError(error.status, message, param="text.format", code=error.code) from None
        options = cache_options(state.settings, tenant, chat)
        requests = await state.builder.build([prompt_ids], params, chat.requested_max_tokens, 1, options)
        fingerprint = state.engine.queries.version.tokenizer.fingerprint
        streams = start(state, requests)
    reads_calls = bool(chat.tools) and chat.tool_choice != "none"
    shape = ResponseShape(
        item_id("resp"),
        answering_model(state.settings, body.model),
        _echo(body),
        parser if reads_calls else None,
        max_calls=1 if body.parallel_tool_calls is False else None,
        reasoning=reads_reasoning,
    )
    turn = history + input_messages(body.input)

    def keep(out) -> None:
        if not body.store:
            return
        reply = assistant_message(shape.message_text, shape.calls)
        state.responses.put(
            shape.response_id,
            StoredResponse(
                tenant=tenant,
                body=shape.finished_body,
                input_items=input_items(body.input),
                messages=turn + ([reply] if reply is not None else []),
                prompt_text=prompt_text,
                prompt_ids=list(prompt_ids),
                output_ids=list(out.token_ids),
                tokenizer=fingerprint,
            ),
        )

    if body.stream:
        return StreamingResponse(
            _events(state, streams[0], shape, keep),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    finals = await collect(request, streams, state.metrics)
    result = shape.final(finals[0])
    keep(finals[0])
    return result


async def _events(state, stream: AsyncIterator, shape: ResponseShape, keep) -> AsyncIterator[str]:
    for event in shape.opening():
        yield event
    try:
        async for out in stream:
            if out.finished and out.finish_reason == "error":
                failure = request_failed(out)
                yield shape.failed(failure.message, failure.code)
                return
            for event in shape.events(out):
                yield event
            if out.finished:
                state.metrics.observe_finished(out)
                keep(out)
    except EngineDeadError as error:
        failure = engine_dead(error)
        yield shape.failed(failure.message, failure.code)
    finally:
        await stream.aclose()


@response_routes.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str):
    state = server_state(request)
    return state.responses.get(response_id, state.auth.tenant(request)).body


@response_routes.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    state = server_state(request)
    state.responses.delete(response_id, state.auth.tenant(request))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@response_routes.get("/v1/responses/{response_id}/input_items")
async def get_input_items(
    request: Request,
    response_id: str,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: Optional[str] = None,
):
    """The response's input items as OpenAI lists them: newest first unless `order` is asc, `limit` a page, from
    the item after `after`."""
    state = server_state(request)
    items = state.responses.get(response_id, state.auth.tenant(request)).input_items
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
