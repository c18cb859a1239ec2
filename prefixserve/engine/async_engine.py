"""AsyncLLMEngine: the engine loop in one background thread, one async stream per request.

Callers on the event loop only tokenize and validate (so bad input fails fast,
in the caller); adds and aborts travel to the engine thread through a queue
and take effect between steps, so the model never runs under a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import AsyncIterator, Optional

from ..config import EngineConfig
from .engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .request import Request
from .sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread crashed; requests cannot be served until a restart."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="prefixserve-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- event loop side
    @property
    def is_dead(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def make_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                     cache_salt: Optional[str] = None) -> Request:
        """Tokenize and validate now, in the caller; raises ValueError / TypeError on bad input."""
        return self.engine.make_request(prompt, params, request_id, cache_salt)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request made by `make_request`; yields an output per step until it finishes.

        Leaving the iteration early (a client that went away) aborts the request and frees its blocks.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", request))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    async def call(self, function):
        """Run `function(engine)` on the engine thread between steps (a consistent view); returns its result."""
        if self.is_dead:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (function, future)))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------- engine thread side
    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
        except BaseException as error:  # surface the crash to every waiting client
            self._error = error
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine loop stopped: {error!r}"))
            raise

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                function, future = payload
                try:
                    future.set_result(function(self.engine))
                except Exception as error:
                    future.set_exception(error)
            elif kind == "add":
                try:
                    self.engine.submit(payload)
                except ValueError as error:
                    self._deliver(payload.request_id, error)
            else:
                self.engine.abort_request(payload)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the client's loop is closed
            pass
