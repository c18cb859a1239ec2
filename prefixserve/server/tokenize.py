"""vLLM's /tokenize and /detokenize: what a prompt is in this server's tokens, and back.

    POST /tokenize    {"prompt": "text", "add_special_tokens": true}                 (a completion prompt)
                      {"messages": [...], "add_generation_prompt": true}            (a chat, its template)
                  ->  {"count": N, "max_model_len": L, "tokens": [ids], "token_strs": null | [strings]}
    POST /detokenize  {"tokens": [ids]}  ->  {"prompt": "text"}

The same tokenizer, template and limits as generation (vLLM's bench client sizes its prompts with
them); authenticated like the generation routes. Tokenizing runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import APIRouter, Request
from pydantic import Field

from ..engine.limits import MAX_TOKENIZE_IDS
from ..http import APIError
from ..http_body import parse_json_body
from .inputs import chat_messages, read_body
from .protocol import ChatMessage, OpenAIBody
from .routes import check_model, server_state

tokenize_routes = APIRouter()


class TokenizeCompletion(OpenAIBody):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(OpenAIBody):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class Detokenize(OpenAIBody):
    model: Optional[str] = None
    tokens: list[int] = Field(max_length=MAX_TOKENIZE_IDS)


async def _tokenize_form(request: Request) -> type:
    """Either form: `messages` makes it a chat, `prompt` a completion prompt; a body with neither is told so."""
    try:
        payload = parse_json_body(await request.body())
    except ValueError:
        return TokenizeCompletion  # read_body names the JSON error
    if isinstance(payload, dict) and "messages" in payload:
        return TokenizeChat
    if isinstance(payload, dict) and "prompt" not in payload:
        raise APIError(
            422,
            "give prompt (a string, tokenized as a completion prompt) or messages (a chat, through its template)",
            param="prompt",
            code="invalid_value",
        )
    return TokenizeCompletion


def _token_strs(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.token_bytes(token_id).decode("utf-8", errors="replace") for token_id in ids]


@tokenize_routes.post("/tokenize")
async def tokenize(request: Request):
    state = server_state(request)
    state.auth.tenant(request)
    body = await read_body(request, await _tokenize_form(request))
    check_model(state.settings, body.model)
    builder = state.builder
    tokenizer = builder.tokenizer
    if isinstance(body, TokenizeChat):
        messages = chat_messages(body)
        builder.check_text_size(sum(len(message["content"]) for message in messages), "messages")
        try:
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages, body.add_generation_prompt)
        except Exception as error:  # a template may reject a conversation (e.g. role order)
            raise APIError(
                400, f"the chat template rejected these messages: {error}", param="messages", code="invalid_messages"
            ) from None
    else:
        builder.check_text_size(len(body.prompt), "prompt")
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": builder.max_model_len,
        "tokens": ids,
        "token_strs": _token_strs(tokenizer, ids) if body.return_token_strs else None,
    }


@tokenize_routes.post("/detokenize")
async def detokenize(request: Request):
    state = server_state(request)
    state.auth.tenant(request)
    body = await read_body(request, Detokenize)
    check_model(state.settings, body.model)
    tokenizer = state.builder.tokenizer
    bad = next((token for token in body.tokens if not 0 <= token < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside this model's vocabulary [0, {tokenizer.vocab_size})",
            param="tokens",
            code="invalid_tokens",
        )
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}
