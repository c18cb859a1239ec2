"""AsyncLLMEngine: the engine loop in one background thread, one async stream per request.

Callers on the event loop only tokenize and validate (so bad input fails fast,
in the caller); adds and aborts travel to the engine thread through a queue
and take effect between steps, so the model never runs under a lock.

Nothing one request does may stop the loop: LLMEngine.step fails a request that
breaks alone, and should a step still raise, the requests of that moment are
failed, the loop carries on, and only repeated failures with no step succeeding
in between declare the engine dead. Readers on the event loop never touch
engine state: they read an immutable snapshot the engine thread publishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from ..cache.stats import CacheStats, CacheUsage
from ..config import EngineConfig
from ..lora.lora_request import LoRARequest
from .assembly import build_engine
from .engine import LLMEngine, PromptType
from .model_version import ModelVersion
from .operations.reload import swap_model
from .outputs import RequestOutput
from .queries import EngineQueries
from .request import Request
from .sampling_params import SamplingParams
from .tenant_report import tenant_report

logger = logging.getLogger("prefixserve")
MAX_CONSECUTIVE_STEP_FAILURES = 3  # steps in a row that raise, with none succeeding, before the engine is dead


class EngineDeadError(RuntimeError):
    """The engine thread stopped; requests cannot be served until a restart."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters and gauges at one instant, published by the engine thread for readers elsewhere."""

    stats: CacheStats
    usage: CacheUsage
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prefill_tokens_computed: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_finished_by_reason: dict  # finish reason -> requests (vllm:request_success_total)
    tiers: dict = field(default_factory=dict)  # tier name -> kv_tiers.TierSnapshot
    reuse_gaps: dict = field(default_factory=dict)  # ReuseGapTracker.snapshot(): read-only
    tenants: dict = field(default_factory=dict)  # tenant_report(): each tenant's shares, holdings and counters
    # with enable_lora: (max_loras, names of the adapters running, names of those waiting); None: no adapters
    lora: Optional[tuple] = None
    # with speculative_config: a copy of engine/speculation.py's SpecDecodeStats; None: speculation off
    spec_decode: Optional[object] = None
    time: float = 0.0  # unix seconds when it was taken

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineSnapshot":
        return cls(
            stats=engine.cache.stats.snapshot(),
            usage=engine.cache.usage(),
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_preemptions=engine.scheduler.num_preemptions,
            num_prefill_tokens_computed=engine.counters.num_prefill_tokens_computed,
            num_prompt_tokens=engine.counters.num_prompt_tokens,
            num_generation_tokens=engine.counters.num_generation_tokens,
            num_finished_by_reason=dict(engine.scheduler.num_finished_by_reason),
            tiers=engine.tiers.snapshot(),
            reuse_gaps=engine.reuse_gaps.snapshot(),
            tenants=tenant_report(engine)["tenants"],
            lora=lora_names(engine),
            spec_decode=spec_decode_stats(engine),
            time=time.time(),
        )


def spec_decode_stats(engine: LLMEngine):
    """A copy of the speculation's counters (vllm:spec_decode_*), None where speculation is off."""
    speculation = engine.scheduler.speculation
    return None if speculation is None else speculation.stats.copy()


def lora_names(engine: LLMEngine) -> Optional[tuple]:
    """(max_loras, adapters running, adapters waiting) by name, for vllm:lora_requests_info; None without LoRA."""
    if not engine.config.enable_lora:
        return None
    scheduler = engine.scheduler

    def names(requests) -> list[str]:
        return sorted({request.lora.name for request in requests if request.lora is not None})

    return engine.config.max_loras, names(scheduler.running), names(scheduler.waiting)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = build_engine(config)
        self.queries = EngineQueries(self.engine)  # what the event loop may read (queries.py)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._pending_lock = threading.Lock()
        self._num_pending_adds = 0  # queued adds the engine thread has not taken yet
        self._idle_calls: list = []  # (function, future) to run once no request is unfinished (a reload)
        # Liveness, written by the engine thread only (the server's progress beats read it): steps finished,
        # and when the step under way began (time.monotonic(); None between steps).
        self.num_steps = 0
        self.step_started: Optional[float] = None
        self.snapshot = EngineSnapshot.of(self.engine)
        self._thread = threading.Thread(target=self._loop, name="prefixserve-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- event loop side
    @property
    def is_dead(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, including adds still on their way to the engine thread."""
        with self._pending_lock:
            return self.snapshot.num_waiting + self._num_pending_adds

    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: Optional[str] = None,
        cache_salt: Optional[str] = None,
        prefix_ttl: Optional[float] = None,
        tenant: Optional[str] = None,
        cache_retention: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> Request:
        """Tokenize and validate in the caller (thread-safe: reads only what is fixed at start-up, and the
        locked adapter registry); raises ValueError / TypeError on bad input."""
        return self.engine.make_request(
            prompt,
            params,
            request_id,
            cache_salt,
            prefix_ttl=prefix_ttl,
            tenant=tenant,
            cache_retention=cache_retention,
            lora_request=lora_request,
        )

    def add(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request now (it counts as waiting at once) and return the stream of its outputs.

        Leaving the stream early (a client that went away) aborts the request and frees its blocks.
        """
        if self.is_dead:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}; restart the server")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        with self._pending_lock:
            self._num_pending_adds += 1
        self._commands.put(("add", request))
        self._wake.set()
        return self._outputs(request.request_id, stream)

    async def _outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def call(self, function):
        """Run `function(engine)` on the engine thread between steps (a consistent view); returns its result."""
        return await self._on_engine_thread("call", function)

    async def load_version(self, model: Optional[str] = None) -> ModelVersion:
        """Load `model` (None: the served path again) in a worker thread while the engine serves;
        raises FileNotFoundError / ValueError naming the fix when it cannot be swapped in."""
        return await asyncio.to_thread(self.engine.load_version, model)

    async def swap(self, version: ModelVersion):
        """Swap `version` in once the requests already queued have finished on the old one (reload.py);
        returns the ReloadReport. Callers must make no request until this returns (the server's
        ReloadGate sees to it): one made before the swap is refused after it."""
        return await self._on_engine_thread("idle_call", lambda engine: swap_model(engine, version))

    async def _on_engine_thread(self, kind: str, function):
        """Run `function(engine)` on the engine thread: between steps ("call") or once no request is
        unfinished ("idle_call"); returns its result."""
        if self.is_dead:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}; restart the server")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((kind, (function, future)))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        """Stop the loop, then flush what the KV tiers still have to write."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # ---------------------------------------------------------- engine thread side
    def _loop(self) -> None:
        num_failures = 0
        try:
            while not self._stopped:
                self._apply_commands()
                if self._idle_calls and not self.engine.has_unfinished_requests():
                    self._run_idle_calls()
                if not self.engine.has_unfinished_requests():
                    self.snapshot = EngineSnapshot.of(self.engine)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self.step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as error:  # a bug, not a request's input: fail what was in flight, carry on
                    num_failures += 1
                    logger.exception("engine step failed (%d in a row); failing the requests in flight", num_failures)
                    if num_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    self._fail_unfinished(error)
                    continue
                finally:
                    self.step_started = None
                num_failures = 0
                self.num_steps += 1
                for output in outputs:
                    self._deliver(output.request_id, output)
                self.snapshot = EngineSnapshot.of(self.engine)
        except BaseException as error:  # surface the crash to every waiting client
            self._error = error
            for _, future in self._idle_calls:
                future.set_exception(EngineDeadError(f"the engine loop stopped: {error!r}; restart the server"))
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine loop stopped: {error!r}; restart the server"))
            raise

    def _run_idle_calls(self) -> None:
        calls, self._idle_calls = self._idle_calls, []
        for function, future in calls:
            self._run(function, future)
        self.snapshot = EngineSnapshot.of(self.engine)

    def _run(self, function, future: concurrent.futures.Future) -> None:
        try:
            future.set_result(function(self.engine))
        except Exception as error:
            future.set_exception(error)

    def _fail_unfinished(self, error: Exception) -> None:
        scheduler = self.engine.scheduler
        for request in [*scheduler.running, *scheduler.waiting]:
            output = self.engine.abort_request(request.request_id)
            if output is not None:
                output.finish_reason = "error"
                output.error = f"the engine failed while serving this request ({type(error).__name__})"
                self._deliver(request.request_id, output)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                self._run(*payload)
            elif kind == "idle_call":
                self._idle_calls.append(payload)
            elif kind == "add":
                try:
                    self.engine.submit(payload)
                except ValueError as error:
                    self._deliver(payload.request_id, error)
                finally:
                    with self._pending_lock:
                        self._num_pending_adds -= 1
                        self.snapshot = EngineSnapshot.of(self.engine)
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
