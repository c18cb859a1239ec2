"""vLLM's runtime LoRA routes, behind the admin key: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}. Off unless the server runs with --allow-runtime-lora-updating (vLLM:
VLLM_ALLOW_RUNTIME_LORA_UPDATING). A load reads and checks the adapter before its name serves anything, so a bad
adapter is a 400 naming the cause while the server keeps serving; loading a name again replaces its weights."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ..http import APIError
from ..lora.adapter_error import AdapterError
from ..lora.lora_request import LoRARequest
from .inputs import read_body
from .protocol import OpenAIBody

lora_routes = APIRouter()


class LoadLoRAAdapter(OpenAIBody):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(OpenAIBody):
    lora_name: str


def _updatable(request: Request):
    state = request.app.state.server
    if not state.engine.engine.config.enable_lora:
        raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora", code="lora_disabled")
    if not state.settings.lora_modules.runtime_updates:
        raise APIError(
            404,
            "loading LoRA adapters at run time is off; start the server with --allow-runtime-lora-updating",
            "not_found_error",
            code="runtime_lora_updating_disabled",
        )
    return state


@lora_routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    state = _updatable(request)
    body = await read_body(request, LoadLoRAAdapter)
    modules, name = state.settings.lora_modules, body.lora_name
    if not name or "@" in name or name == state.settings.served_model_name:
        raise APIError(
            400,
            f"lora_name {name!r} must be non-empty, hold no '@' and differ from the served model's name",
            param="lora_name",
            code="invalid_value",
        )
    probe = LoRARequest(name, 1, body.lora_path)
    try:
        await state.engine.call(lambda core: core.inputs.adapter_of(probe))
    except AdapterError as error:
        raise APIError(400, str(error), param="lora_path", code="invalid_lora_adapter") from None
    modules.add(name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@lora_routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    state = _updatable(request)
    body = await read_body(request, UnloadLoRAAdapter)
    if state.settings.lora_modules.remove(body.lora_name) is None:
        raise APIError(
            404,
            f"no LoRA adapter {body.lora_name!r} is loaded; GET /v1/models lists them",
            "not_found_error",
            param="lora_name",
            code="lora_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
