"""POST /v1/admin/reload: serve a new model version without a restart, never mixing versions.

A request is tokenized with the current tokenizer and queued inside `ReloadGate.admitting`;
a reload loads the new weights first (requests keep flowing), then holds the gate shut
while the engine drains what was queued on the old version and swaps (engine/operations/reload.py).
Requests that arrive meanwhile wait at the gate and run on the new version: none fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Optional

from fastapi import APIRouter, Request

from ..engine.async_engine import EngineDeadError
from ..engine.operations.reload import IncompatibleModelError, purge_previous_remote
from ..http import APIError
from ..http_body import parse_json_body
from .generation import engine_dead

reload_routes = APIRouter()


class ReloadGate:
    """Many requests may be admitting at once; a reload waits for them, then keeps new ones out."""

    def __init__(self) -> None:
        # asyncio primitives bind to the running loop at first use (Python 3.10+), so they can be made here.
        self._condition = asyncio.Condition()
        self._num_admitting = 0
        self._is_reloading = False
        self.reload_lock = asyncio.Lock()  # one reload at a time, its load included

    @contextlib.asynccontextmanager
    async def admitting(self):
        """Tokenize and queue inside this: no reload swaps the model meanwhile."""
        condition = self._condition
        async with condition:
            await condition.wait_for(lambda: not self._is_reloading)
            self._num_admitting += 1
        try:
            yield
        finally:
            async with condition:
                self._num_admitting -= 1
                condition.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        """Hold new requests back until the body is done (one caller at a time: see reload_lock)."""
        condition = self._condition
        async with condition:
            self._is_reloading = True
            try:
                await condition.wait_for(lambda: self._num_admitting == 0)
            except BaseException:
                self._is_reloading = False
                condition.notify_all()
                raise
        try:
            yield
        finally:
            async with condition:
                self._is_reloading = False
                condition.notify_all()


async def _reload_body(request: Request) -> tuple[Optional[str], bool]:
    """(model or None, purge_remote) from an empty body or {"model": ..., "purge_remote": bool}."""
    raw = await request.body()
    if not raw.strip():
        return None, False
    try:
        body = parse_json_body(raw)
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_json") from None
    if not isinstance(body, dict) or set(body) - {"model", "purge_remote"}:
        raise APIError(
            400,
            'the body is empty (reload the served checkpoint again) or {"model": "<checkpoint '
            'directory, .gguf file or model name>", "purge_remote": false}',
            code="invalid_value",
        )
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise APIError(
            400,
            "model must be a non-empty string: a checkpoint directory, a .gguf file or a model name",
            param="model",
            code="invalid_value",
        )
    purge_remote = body.get("purge_remote", False)
    if not isinstance(purge_remote, bool):
        raise APIError(400, "purge_remote must be true or false", param="purge_remote", code="invalid_value")
    return model, purge_remote


@reload_routes.post("/v1/admin/reload")
async def reload_model(request: Request):
    """Load `model` (default: the served path again) and swap it in; answers once new requests use it."""
    state = request.app.state.server
    model, purge_remote = await _reload_body(request)
    if purge_remote and not state.engine.queries.has_shared_tier:
        raise APIError(
            400,
            "purge_remote needs a remote tier (--kv-remote-url); leave it out",
            param="purge_remote",
            code="invalid_value",
        )
    gate: ReloadGate = state.reload_gate
    if gate.reload_lock.locked():
        raise APIError(409, "a reload is already in progress; wait for it to finish", code="reload_in_progress")
    began = time.perf_counter()
    async with gate.reload_lock:
        try:
            version = await state.engine.load_version(model)  # requests keep flowing meanwhile
            loaded = time.perf_counter()
            async with gate.exclusive():
                report = await state.engine.swap(version)
        except EngineDeadError as error:
            raise engine_dead(error) from None
        except (FileNotFoundError, IncompatibleModelError, ValueError, OSError) as error:
            raise APIError(
                400, f"cannot reload {model or 'the served checkpoint'}: {error}", param="model", code="invalid_model"
            ) from None
    body = report.to_dict()
    body.update(object="reload", load_seconds=loaded - began, held_seconds=time.perf_counter() - loaded)
    if purge_remote:  # after the gate opened: deleting many keys must not hold requests back
        body["purged_remote_records"] = await asyncio.to_thread(purge_previous_remote, state.engine.engine, report)
    return body
