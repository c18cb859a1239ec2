"""Continuous batching with chunked prefill over the prefix cache. Plain Python, no torch.

Each step has a token budget (`max_num_batched_tokens`). Running requests are
served first, oldest first, so decodes never wait behind a long prompt; what
is left of the budget admits waiting requests, whose cached prefix costs
nothing: admission asks one interface, the prefix sources (prefix_sources.py:
the device radix, then each tier below it), what a request's prefix holds and
where, and a request whose prefix is being read back from a tier waits in
RequestStatus.WAITING_FOR_KV; one whose prefix a running request is computing
now waits for it (in_flight.py). A prompt longer than the budget is prefilled in chunks over several
steps. When blocks run out, cold cached leaves are evicted (inside
`RadixCache.allocate`); if that is not enough, the newest running request is
preempted: its blocks are released and it is recomputed later, mostly from
the cache, since its own full blocks stay cached.

A request that cannot get a block even alone (pinned prefixes hold the rest of the pool) is
never preempted in a loop: it finishes with "length" if it has output, else with "error".

A LongRoPE model's sequence that grows past the pre-training length is preempted and recomputed with the
long factors, in their own key scope (Request.rotate_long), as transformers recomputes it.

Where sliding-window layers keep their K/V in a pool of their own, room there is checked with the blocks' and a
cached match is cut to what it holds (request_windows.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from ..cache import Block, BlockKeyer, RadixCache
from ..cache.hot_prefixes import HotPrefixPolicy
from ..cache.reuse_gaps import ReuseGapTracker
from ..cache.window_slots import WindowSlots
from .in_flight import waits_for_in_flight
from .prefix_sources import PrefixSources
from .request import Request, RequestStatus
from .request_windows import RequestWindows
from .speculation import Speculation
from .stopping import check_stop

LPM_WINDOW = 64  # waiting requests ranked by cached prefix per step under "lpm"


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended unrun: they can never fit

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        cache: RadixCache,
        keyer: BlockKeyer,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        reuse_gaps: Optional[ReuseGapTracker] = None,
        hot_prefixes: Optional[HotPrefixPolicy] = None,
        window_slots: Optional[WindowSlots] = None,
        long_rope_after: Optional[int] = None,
        sources: Optional[PrefixSources] = None,
        max_loras: Optional[int] = None,
        speculation: Optional[Speculation] = None,
    ) -> None:
        self.cache = cache
        self.speculation = speculation  # prompt-lookup drafts for decoding requests (speculation.py); None: off
        self.num_output_tokens_last_step = 0  # tokens the last update() appended (more than one per request drafts)
        # the engine's reading of a request's text for stop strings after a token (a drafted request's kept tokens
        # are read one at a time, as plain steps would): the stop string completed, or None
        self.stop_string: Optional[Callable[[Request], Optional[str]]] = None
        self.max_loras = max_loras  # the most LoRA adapters among running requests (None: no adapters served)
        self.windows = RequestWindows(window_slots)
        # Where a waiting request's prefix is held (the device, then the tiers): the engine hands in one over its
        # tiers; built here over the device alone when none is given (a scheduler without an engine).
        self.sources = sources or PrefixSources(cache, keyer, self.windows, enable_prefix_caching)
        # LongRoPE (model/families/rope.py): a sequence growing past this many tokens is recomputed with long factors
        self.long_rope_after = long_rope_after
        self.reuse_gaps = reuse_gaps  # measures release -> next use of prefixes, for TTL planning
        self.hot_prefixes = hot_prefixes  # counts reuse of cached prefixes; the engine ticks it to pin
        self.keyer = keyer
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_finished_by_reason: Counter[str] = Counter()  # "stop" | "length" | "abort" | "error" -> requests

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        needed = self._blocks_for(request.num_tokens + 1)
        if needed > self.cache.pool.num_blocks:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs {needed} KV blocks but the pool has "
                f"{self.cache.pool.num_blocks}; raise kv_cache_memory_bytes or shorten the prompt"
            )
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Optional[Request]:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    self.finish_request(request, "abort")
                    return request
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.sources.collect()  # tier reads that came back: their requests may be admitted again
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            request.draft = (
                self.speculation.draft(request, len(self.running), budget, self.long_rope_after, self.windows.slots)
                if self.speculation is not None
                else []
            )
            num_new += len(request.draft)
            if (
                self.long_rope_after is not None
                and not request.long_rope
                and request.num_computed_tokens + num_new > self.long_rope_after
            ):
                # transformers recomputes the whole sequence with the long factors here: so do we
                request.rotate_long()
                output.preempted.append(self._preempt(request))
                continue
            needed = max(0, self._blocks_for(request.num_computed_tokens + num_new) - len(request.blocks))
            self.windows.slide(request)
            while not self._fits(needed, request.owner) and self.running[-1] is not request:
                output.preempted.append(self._preempt(self.running[-1]))
            if not self._fits(needed, request.owner) and not (index == 0 and self._fits(needed, request.owner, False)):
                # (alone, it may go below another tenant's minimum rather than never finish: allocate counts it)
                if index == 0:  # alone, and still no room: waiting would never end
                    self._finish_unfittable(request, needed, output)
                else:  # older requests hold the blocks; they will finish
                    output.preempted.append(self._preempt(request))
                continue
            new_blocks = self.cache.allocate(needed, request.owner)
            request.blocks += new_blocks
            self.windows.allocated(new_blocks)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        # A step that had to preempt admits nobody new: the pool is the bottleneck.
        if not output.preempted:
            self._admit_waiting(output, budget)
        return output

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            chosen = self._next_waiting()
            if chosen is None:
                break
            request, hit = chosen
            if not self._adapter_fits(request):
                break  # its adapter would be one too many in the batch: it waits for one to finish, as in vLLM
            num_cached = len(hit) * self.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            needed = self._blocks_for(num_cached + num_new) - len(hit)
            window_start = self.windows.start_of(num_cached)
            if not self.windows.can_admit(hit, window_start, needed):
                break  # the window layers' pool is held by running requests: they will move on
            blocks = self.cache.admit(hit, needed, request.prefix_ttl, request.owner)
            if blocks is None:
                if self.running or output.scheduled:
                    break  # running requests will free blocks
                if self.hot_prefixes is not None and self.hot_prefixes.unpin_all(self.cache):
                    continue  # policy pins are soft: a request that needs the room comes first
                # Alone, it may go below another tenant's minimum rather than wait for ever (allocate counts it).
                blocks = self.cache.admit(hit, needed, request.prefix_ttl, request.owner, guard_minimums=False)
                if blocks is None:
                    self._finish_unfittable(request, needed, output)  # nothing holds blocks but pins: never fits
                    continue
            self.waiting.remove(request)
            request.blocks = blocks
            request.num_computed_tokens = num_cached
            self.windows.admitted(request, window_start)
            if not request.was_admitted:
                request.metrics.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                self.cache.stats.record_query(request.num_prompt_tokens, num_cached, request.tenant)
                if self.reuse_gaps is not None and self.enable_prefix_caching:
                    self.reuse_gaps.admitted(request.tenant, request.block_keys)
                if self.hot_prefixes is not None and hit:
                    self.hot_prefixes.observe(request.block_keys[: len(hit)])
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _next_waiting(self) -> Optional[tuple[Request, list[Block]]]:
        """The request to admit next and its cached prefix, from the first LPM_WINDOW waiting requests that are
        not waiting for a tier read; None when each of those waits for a running request to compute the prefix
        they share (in_flight.py). Requests waiting for either are passed by others.

        The tiers are asked only for requests whose prompts fit in the room the pool has now, counted from the
        head of the queue: loading for a whole burst at once would have the burst's blocks evict one another
        before any of its requests is admitted."""
        candidates, num_considered = [], 0
        room = self.cache.pool.num_free_blocks + self.cache.num_reclaimable_blocks
        for request in self.waiting:
            room -= self._blocks_for(request.num_prompt_tokens)
            if request.status is not RequestStatus.WAITING:
                continue
            if num_considered == LPM_WINDOW:
                break
            num_considered += 1
            hit = self.sources.ready_prefix(request, ask_lower=room >= 0)
            if hit is None:  # its prefix is being read back from a tier
                continue
            if self.enable_prefix_caching and waits_for_in_flight(request, len(hit), self.running, self.block_size):
                continue
            if self.policy == "fcfs":
                return request, hit
            candidates.append((len(hit), -len(candidates), request, hit))
        if not candidates:
            return None
        _, _, request, hit = max(candidates, key=lambda item: (item[0], item[1]))
        return request, hit

    def _finish_unfittable(self, request: Request, num_needed: int, output: SchedulerOutput) -> None:
        if request.num_output_tokens > 0:
            self.finish_request(request, "length")
        else:
            usage = self.cache.usage()
            self.finish_request(
                request,
                "error",
                error=(
                    f"the request needs {num_needed} more KV blocks but pinned prefixes hold "
                    f"{usage.num_pinned_blocks} of the pool's {self.cache.pool.num_blocks}; unpin prefixes, "
                    "raise kv_cache_memory_bytes or send a shorter prompt"
                ),
            )
        output.finished.append(request)

    def _preempt(self, request: Request) -> Request:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.draft = []
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        return request

    def _adapter_fits(self, request: Request) -> bool:
        if request.lora is None or self.max_loras is None:
            return True
        running = {r.lora.fingerprint for r in self.running if r.lora is not None}
        return request.lora.fingerprint in running or len(running) < self.max_loras

    def _fits(self, num_blocks: int, requester: Optional[str] = None, guard_minimums: bool = True) -> bool:
        """Room for `num_blocks` new blocks for `requester`, in the pool and in the window layers' pool."""
        return self.cache.can_allocate(num_blocks, requester, guard_minimums) and self.windows.fits(num_blocks)

    def _release(self, request: Request) -> None:
        self.windows.released(request)
        self.cache.release(request.blocks)
        request.blocks = []
        request.num_inserted_blocks = 0

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------- update
    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[Optional[int]],
        logprobs: Optional[Sequence[Optional[object]]] = None,
    ) -> list[Request]:
        """Advance each scheduled request; `sampled_token_ids[i]` is None for a mid-prompt chunk,
        `logprobs[i]` its TokenLogprob when the request asked for them.

        Returns the requests that produced a token or finished this step.
        """
        updated = []
        self.num_output_tokens_last_step = 0
        logprobs = logprobs or [None] * len(output.scheduled)
        for (request, num_new), token_id, logprob in zip(output.scheduled, sampled_token_ids, logprobs):
            if request.is_finished:  # aborted while the step ran
                continue
            if request.draft:  # every row sampled: a list of tokens (and of logprobs)
                self._update_drafted(request, token_id, logprob)
                updated.append(request)
                continue
            request.num_computed_tokens += num_new
            if self.enable_prefix_caching:
                self._insert_full_blocks(request)
            if token_id is None:
                continue
            request.append_output_token(token_id, logprob)
            self.num_output_tokens_last_step += 1
            updated.append(request)
            refused = request.grammar.accept(token_id) if request.grammar is not None else None
            if refused is not None:  # only a token the mask allowed is chosen: the grammar's own limits
                self.finish_request(request, "error", error=refused)
                continue
            ended = check_stop(request)
            if ended is not None:
                self.finish_request(request, *ended)
        return updated

    def _update_drafted(self, request: Request, kept: list[int], logprobs: Optional[list]) -> None:
        """A drafted request's step: the kept tokens (the runner's verdict, speculation.py) appended one at a time,
        each as its own decode step would (the position before it counted computed, full blocks inserted, stops
        checked)."""
        draft, request.draft = request.draft, []
        self.speculation.record(request, draft, kept)
        for position, token_id in enumerate(kept):
            request.num_computed_tokens += 1
            if self.enable_prefix_caching:
                self._insert_full_blocks(request)
            request.append_output_token(token_id, None if logprobs is None else logprobs[position])
            self.num_output_tokens_last_step += 1
            ended = check_stop(request)
            if ended is not None:
                self.finish_request(request, *ended)
                return
            if request.sampling_params.stop and self.stop_string is not None:
                stop = self.stop_string(request)
                if stop is not None:
                    self.finish_request(request, "stop", stop)
                if request.is_finished:
                    return

    def _insert_full_blocks(self, request: Request) -> None:
        """Register blocks whose KV is now fully written, prompt and output alike."""
        size = self.block_size
        num_full = request.num_computed_tokens // size
        if num_full <= request.num_inserted_blocks or request.cache_retention == "none":
            return  # "none": its blocks stay private and are freed when it finishes
        keys = self.keyer.extend(request.block_keys, request.scope_digest, request.token_ids, request.private_from)
        blocks = request.blocks
        for i in range(request.num_inserted_blocks, num_full):
            parent = blocks[i - 1] if i else request.scope_digest
            blocks[i] = self.cache.insert(
                blocks[i],
                keys[i],
                request.token_ids[i * size : (i + 1) * size],
                parent,
                request.prefix_ttl,
                request.block_scope(i),
                device_only=request.cache_retention == "device",
                owner=request.block_owner(i),
                lora=request.lora_label,
            )
        request.num_inserted_blocks = num_full

    def finish_request(
        self, request: Request, reason: str, stop_reason: Optional[object] = None, error: Optional[str] = None
    ) -> None:
        """The one place a request finishes (tokens, stop strings, errors, aborts): it leaves its queue
        and its blocks are released. A finished request may be finished again to restate why."""
        if request.is_finished:  # restated: counted under its new reason
            self.num_finished_by_reason[request.finish_reason] -= 1
        self.num_finished_by_reason[reason] += 1
        request.finish(reason, stop_reason, error)
        request.draft = []
        if self.speculation is not None:
            self.speculation.forget(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.reuse_gaps is not None and request.num_inserted_blocks:
            self.reuse_gaps.released(
                request.tenant,
                request.block_keys[: request.num_inserted_blocks],
                request.num_prompt_tokens // self.block_size,
            )
        self._release(request)
