"""LLMEngine: the synchronous core. add_request, then step until done; a step is

    schedule (plain Python) -> run the model (tensors) -> update requests and the cache

A failure is contained to the requests it touches: a model step that raises ends that step's
requests with finish_reason "error", a detokenizer that raises ends its own request; the engine
stays usable either way.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ..cache.scoping import PromptScoper
from ..lora.lora_request import LoRARequest
from .engine_parts import EngineParts
from .input_processor import PromptType
from .limits import RANGES
from .model_version import ModelVersion, load_version, weight_format
from .operations.pins import Pin, restore_pins
from .operations.reload import ReloadReport, check_swappable, swap_model
from .outputs import RequestOutput
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput
from .step_counters import StepCounters

logger = logging.getLogger("prefixserve")


class LLMEngine:
    """The step over parts built once and handed in (assembly.py's build_engine makes them from a config)."""

    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.device, self.dtype, self.weights, self.numerics = parts.device, parts.dtype, parts.weights, parts.numerics
        self.current = parts.current  # the served version, behind the one reference a reload swaps
        self.events = parts.events
        self.cache, self.keyer, self.window_slots = parts.cache, parts.keyer, parts.window_slots
        self.reuse_gaps, self.hot_prefixes = parts.reuse_gaps, parts.hot_prefixes
        self.scheduler, self.runner, self.tiers = parts.scheduler, parts.runner, parts.tiers
        self.inputs, self.outputs, self.pins = parts.inputs, parts.outputs, parts.pins
        # a drafted request's kept tokens are read for stop strings one at a time (engine/speculation.py)
        self.scheduler.stop_string = self._stop_string
        self.kv_events = parts.kv_events
        self.startup_summary = parts.startup_summary
        self.counters = StepCounters()
        self.num_reloads = 0  # hot reloads so far (reload.py); requests made before one are refused after it

    # ------------------------------------------------ the served version
    # Read through the one reference a reload swaps (reload.py): never copied into an attribute.
    @property
    def version(self) -> ModelVersion:
        return self.current.version

    @property
    def tokenizer(self):
        return self.current.version.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.current.version.max_model_len

    @property
    def scope(self):
        return self.current.version.scope

    @property
    def scoper(self) -> PromptScoper:
        return self.current.version.scoper

    # ----------------------------------------------------------- requests
    def add_request(
        self,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        prefix_ttl: Optional[float] = None,
        tenant: Optional[str] = None,
        cache_retention: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> Request:
        request = self.make_request(
            prompt, params, request_id, cache_salt, arrival_time, prefix_ttl, tenant, cache_retention, lora_request
        )
        self.submit(request)
        return request

    def make_request(
        self,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        prefix_ttl: Optional[float] = None,
        tenant: Optional[str] = None,
        cache_retention: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> Request:
        """Tokenize and validate (raises ValueError with the fix); does not touch engine state."""
        version = self.num_reloads
        request = self.inputs.make_request(
            prompt, params, request_id, cache_salt, arrival_time, prefix_ttl, tenant, cache_retention, lora_request
        )
        request.model_version = version
        return request

    def declare_shared_prefix(self, token_ids: list[int]) -> int:
        """Let every tenant (cache salt) reuse the full blocks of this public prefix; returns them."""
        return self.scoper.declare_shared_prefix(token_ids)

    def submit(self, request: Request) -> None:
        """Queue a request built by `make_request`."""
        if request.model_version != self.num_reloads:
            raise ValueError("this request was tokenized for the model version before a reload; make it again")
        self.outputs.add(request)
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.outputs.forget(request.request_id)
            raise

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        request = self.scheduler.abort_request(request_id)
        return None if request is None else self._make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def run_until_finished(
        self, request_ids: list[str], on_finish: Optional[Callable[[RequestOutput], None]] = None
    ) -> list[RequestOutput]:
        """Step until nothing is left; the final outputs of `request_ids`, in that order."""
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    finished[output.request_id] = output
                    if on_finish is not None:
                        on_finish(output)
        return [finished[request_id] for request_id in request_ids]

    # --------------------------------------------------------------- pins
    def pin_prefix(
        self,
        token_ids: list[int],
        tenant: Optional[str] = None,
        salt: Optional[str] = None,
        ttl: Optional[float] = None,
    ) -> Pin:
        """Pin the cached full blocks of `token_ids` (run it through the engine first: see LLM.pin);
        raises ValueError naming the fix."""
        if not self.config.enable_prefix_caching:
            raise ValueError("prefix caching is off (enable_prefix_caching=False): there is nothing to pin")
        if ttl is not None and not RANGES["ttl"].admits(ttl):
            raise ValueError(RANGES["ttl"].problem("a pin's ttl", ttl) + "; None pins until unpinned")
        return self.pins.pin(self.scoper, token_ids, tenant, salt, ttl)

    def keep_prefix(self, token_ids: list[int], tenant: Optional[str], salt: Optional[str], ttl: float) -> Pin:
        """pin_prefix with a lifetime that a later keep of the same prefix extends (Anthropic's cache_control)."""
        return self.pins.keep(self.scoper, token_ids, tenant, salt, ttl)

    def unpin_prefix(self, pin_id: str) -> Optional[Pin]:
        return self.pins.unpin(pin_id, self.scoper)

    def restore_pins(self) -> int:
        """Warm the pins waiting to be restored (after a restart or a reload) and pin them again; call
        with no request in flight. Returns how many were restored."""
        return restore_pins(self)

    def _maintain_pins(self) -> None:
        """Between steps: expire operator pins, and let the hot-prefix policy pin and unpin."""
        if self.pins.pins:
            self.pins.expire(self.scoper)
        if self.hot_prefixes is not None:
            self.hot_prefixes.tick(self.cache)

    # --------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        self.kv_events.step_done()  # what the last step stored and removed goes out (kv_event_publisher.py)
        self._maintain_pins()
        output = self.scheduler.schedule()
        outputs = [self._detokenized_output(request) for request in output.finished]
        if output.is_empty:
            self.scheduler.sources.wait_for_reads()  # only requests waiting for a tier read: do not spin
            return outputs
        self.counters.scheduled(output.scheduled)
        began = time.perf_counter()
        try:
            result = self.runner.execute(output.scheduled)
        except Exception as error:  # one bad step must not stop the engine
            return outputs + self._fail_step(output, error)
        self.tiers.context.observe_step(output.scheduled, time.perf_counter() - began)
        updated = self.scheduler.update(output, result.token_ids, result.logprobs)
        self.tiers.writer.write_through()
        self.counters.produced(updated, self.scheduler.num_output_tokens_last_step)
        return outputs + [self._detokenized_output(request) for request in updated]

    def _fail_step(self, output: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """End every request of a step whose model run or sampling raised; their blocks go back."""
        logger.exception("a model step of %d requests failed; they finish with 'error'", len(output.scheduled))
        message = f"the engine failed while running this request ({type(error).__name__}); retry it"
        outputs = []
        for request, _ in output.scheduled:
            if not request.is_finished:
                self.scheduler.finish_request(request, "error", error=message)
                outputs.append(self._make_output(request))
        return outputs

    def _stop_string(self, request: Request) -> Optional[str]:
        """The stop string the request's newest tokens completed (decoding them); a request whose text cannot be
        decoded finishes with "error" (its text alone is broken)."""
        try:
            return self.outputs.detokenize(request)
        except Exception as error:
            logger.exception("detokenizing request %s failed; it finishes with 'error'", request.request_id)
            self.scheduler.finish_request(
                request, "error", error=f"the engine failed to detokenize this request ({type(error).__name__})"
            )
            return None

    def _detokenized_output(self, request: Request) -> RequestOutput:
        if request.is_finished and request.finish_reason == "stop" and isinstance(request.stop_reason, str):
            return self._make_output(request)  # its stop string was read token by token (_stop_string): text final
        stop = self._stop_string(request)
        if stop is not None:  # also at its length limit: the stop string wins, as in vLLM
            self.scheduler.finish_request(request, "stop", stop)
        return self._make_output(request)

    def _make_output(self, request: Request) -> RequestOutput:
        output = self.outputs.make_output(request)
        output.cached_tokens_by_tier = self.tiers.tokens_by_tier(request)
        if request.is_finished:
            self.tiers.reader.forget(request.request_id)
        return output

    def load_version(self, model: Optional[str] = None) -> ModelVersion:
        """Load `model` (None: the served source again) for a reload, packed for this engine's steps, in any thread
        (fixed settings only); raises FileNotFoundError / ValueError (IncompatibleModelError) naming the fix."""
        model = str(self.version.source) if model is None else model
        version = load_version(
            model,
            self.dtype,
            self.device,
            self.numerics,
            self.config.block_size,
            self.config.max_num_batched_tokens,
            weight_format(model, self.config.quantize, self.config.dequantize, self.device),
        )
        check_swappable(self, version)
        return version

    def reload(self, model: Optional[str] = None) -> ReloadReport:
        """Serve another checkpoint (or the same path again) from now on; call with no request in flight.
        Raises FileNotFoundError / ValueError (IncompatibleModelError) naming the fix, changing nothing."""
        return swap_model(self, self.load_version(model))

    def close(self) -> None:
        """Flush what the tiers still have to write, publish the last KV events (a clean shutdown); idempotent."""
        self.tiers.close()
        self.kv_events.shutdown()
