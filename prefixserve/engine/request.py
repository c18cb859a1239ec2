"""One request's state inside the engine.

Following vLLM v1, a request only tracks `num_computed_tokens` catching up with
its token count. A prefix hit starts it ahead; a prefill chunk moves it some
way; a decode moves it by one; a preemption sets it back to zero. No phases.

    token_ids:  [ prompt ................................ | output ... ]
                 ^ cached (hit)  ^ computed so far         ^ len(token_ids)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from ..cache import Block
from ..cache.scoping import long_rope_scope
from ..lora.adapter import LoRAAdapter
from .sampling_params import SamplingParams
from .structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (again, after a preemption)
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is being read back from a lower tier: not admitted meanwhile
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None  # its first admission (None: never admitted yet)
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # seconds between consecutive output tokens (vllm:inter_token_latency_seconds observes each)
    inter_token_latencies: list[float] = field(default_factory=list)

    def record_token(self, now: float) -> None:
        """An output token was produced at `now` (time.monotonic())."""
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    scope_digest: bytes
    # (block index, tenant scope digest): blocks from there on are private; those before are
    # a declared public prefix keyed in `scope_digest`, the unsalted scope (see BlockKeyer.extend).
    private_from: Optional[tuple[int, bytes]] = None
    prompt: Optional[str] = None  # the text, when the prompt came as text
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 4096
    prefix_ttl: Optional[float] = None
    tenant: Optional[str] = None  # who asked: labels statistics (reuse gaps), never part of a key
    # The tenant whose shares (cache/tenant_shares.py) its private blocks count against and whose need it evicts
    # for: its tenant when its prompt is keyed in a private (salted) scope, else None.
    owner: Optional[str] = None
    # None: cached as usual; "device": its KV never leaves the device pool (no host, disk or remote tier);
    # "none": nothing of it is kept once it finishes (its blocks are never cached).
    cache_retention: Optional[str] = None
    lora: Optional[LoRAAdapter] = None  # the LoRA adapter it runs with (its fingerprint is in scope_digest)
    lora_id: Optional[int] = None  # its LoRARequest's lora_int_id (KV events name the adapter by it and by name)
    model_version: int = 0  # the engine's num_reloads when it was made: a request of an older version is refused
    # sampling_params.bad_words as token-id sequences of the version's tokenizer (with and without a leading space)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    grammar: Optional[Grammar] = None  # sampling_params.structured_outputs' matcher, past the output so far
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    draft: list[int] = field(default_factory=list)  # this step's speculated tokens past token_ids (speculation.py)
    num_cached_tokens: int = 0  # prompt tokens found cached at its first admission
    blocks: list[Block] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    num_inserted_blocks: int = 0  # leading blocks registered in the radix index
    window_start: int = 0  # blocks from here on are attached in the window layers' pool (cache/window_slots.py)
    long_rope: bool = False  # LongRoPE: rotated with the long factors (model/families/rope.py), keyed apart
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    error: Optional[str] = None  # why it finished with "error"
    # One TokenLogprob per output token when sampling_params.logprobs is set, else None.
    logprobs: Optional[list] = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.sampling_params.logprobs is not None:
            self.logprobs = []

    def rotate_long(self) -> None:
        """From now on this request rotates with LongRoPE's long factors: its keys move to their own scope
        (computed afresh); the caller recomputes whatever K/V it had."""
        self.long_rope = True
        self.scope_digest = long_rope_scope(self.scope_digest)
        if self.private_from is not None:
            self.private_from = (self.private_from[0], long_rope_scope(self.private_from[1]))
        self.block_keys.clear()

    def block_scope(self, index: int) -> bytes:
        """The scope block `index` of this request belongs to: the tenant's private one from
        `private_from` on, else `scope_digest` (what a tier's encryption key commits to)."""
        if self.private_from is not None and index >= self.private_from[0]:
            return self.private_from[1]
        return self.scope_digest

    @property
    def lora_label(self) -> Optional[tuple[int, str]]:
        """(lora_int_id, name) of its adapter, for the KV events of its blocks; None for the base model."""
        return None if self.lora is None else (self.lora_id, self.lora.name)

    def block_owner(self, index: int) -> Optional[str]:
        """The tenant block `index` counts against: nobody's within a declared public prefix."""
        if self.private_from is not None and index < self.private_from[0]:
            return None
        return self.owner

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def was_admitted(self) -> bool:
        """Admitted at least once (it may be waiting again after a preemption)."""
        return self.metrics.first_scheduled_time is not None

    def append_output_token(self, token_id: int, logprob: Optional[object] = None) -> None:
        """Add a sampled token (and its TokenLogprob, when asked); whether it ends the request is
        stopping.check_stop's to say."""
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def finish(self, reason: str, stop_reason: Optional[object] = None, error: Optional[str] = None) -> None:
        """Mark finished (call through Scheduler.finish_request). Finishing again restates why: a stop
        string found on the token that reached the length limit, or an error, is the later word."""
        if self.status is not RequestStatus.FINISHED:
            self.status = RequestStatus.FINISHED
            self.metrics.finished_time = time.monotonic()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
