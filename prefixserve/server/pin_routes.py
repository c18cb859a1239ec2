"""Operator pins over HTTP: POST /v1/cache/pin, GET /v1/cache/pins, DELETE /v1/cache/pins/{id}.

A pin keeps a prompt's full blocks resident in one tenant's scope (or the public one), for
`ttl` seconds or until removed; with a disk tier it survives restarts (engine/operations/pins.py).
The prompt is tokenized exactly as a request of that tenant would be (a chat is rendered by
the chat template), run once (a one-token generation: a hit when cached, else a prefill),
then pinned, all inside the reload gate so that a reload cannot slip in between.
Admin key only: a pin holds pool memory every tenant shares.
"""

from __future__ import annotations

from typing import Optional, Union

from fastapi import APIRouter, Request
from pydantic import Field

from ..cache.scoping import compose_salt
from ..engine.limits import MAX_NAME_CHARS, RANGES
from ..engine.sampling_params import SamplingParams
from ..http import APIError
from .generation import collect
from .inputs import CacheOptions, read_body
from .protocol import ChatMessage, OpenAIBody
from .routes import start

pin_routes = APIRouter()


class PinBody(OpenAIBody):
    prompt: Union[str, list[int], None] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    tenant: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)  # whose scope; None: public
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    ttl: Optional[float] = Field(default=None, **RANGES["ttl"].field())  # seconds; None: until removed


def _admin(request: Request):
    return request.app.state.server  # admin_only, the router's dependency, has checked the key


@pin_routes.post("/v1/cache/pin")
async def pin_prefix(request: Request):
    state = _admin(request)
    body = await read_body(request, PinBody)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400,
            "give the prefix to pin as 'prompt' (text or token ids) or as 'messages', not both",
            param="prompt",
            code="invalid_value",
        )
    if body.tenant is not None and body.tenant not in set(state.settings.api_keys.values()):
        raise APIError(
            400,
            f"tenant {body.tenant!r} has no API key on this server; pin for a tenant of the keys "
            "file, or leave tenant out to pin in the public scope",
            param="tenant",
            code="unknown_tenant",
        )
    salt = compose_salt(body.tenant, body.cache_salt)
    params = SamplingParams(max_tokens=1)
    async with state.reload_gate.admitting():  # warmed and pinned on one model version
        prompt = await state.builder.chat_prompt(body) if body.messages is not None else body.prompt
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_prompt")
        warmers = await state.builder.build([prompt], params, 1, 1, CacheOptions(salt, None, body.tenant))
        finals = await collect(request, start(state, warmers), state.metrics)
        if finals[0].finish_reason == "error":
            raise APIError(500, f"warming the prefix failed: {finals[0].error}", "server_error", code="pin_failed")
        token_ids = warmers[0].prompt_token_ids

        def pin(core):
            return core.pin_prefix(token_ids, body.tenant, salt, body.ttl).public()

        try:
            return await state.engine.call(pin)
        except ValueError as error:
            raise APIError(400, f"cannot pin this prefix: {error}", param="prompt", code="pin_failed") from None


@pin_routes.get("/v1/cache/pins")
async def list_pins(request: Request):
    state = _admin(request)
    return {"object": "list", "data": await state.engine.call(lambda core: core.pins.listing())}


@pin_routes.delete("/v1/cache/pins/{pin_id}")
async def delete_pin(request: Request, pin_id: str):
    state = _admin(request)
    pin = await state.engine.call(lambda core: core.unpin_prefix(pin_id))
    if pin is None:
        raise APIError(
            404,
            f"no pin {pin_id!r}; GET /v1/cache/pins lists them",
            "not_found_error",
            param="pin_id",
            code="pin_not_found",
        )
    return {"id": pin_id, "object": "cache.pin", "deleted": True}
