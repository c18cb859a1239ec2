"""What other pool sizes would have done: replay a request log through the real radix cache.

Each logged request, in arrival order, goes through the cache the way the engine's scheduler
sends it (one request at a time, nothing else holding blocks):

    match the prompt keys ─> admit (acquire the hit, allocate the rest: evicts cold leaves)
        ─> insert the prompt's and the output's full blocks ─> release

The replay's "tokens" are block ids (block_size 1 in RadixCache), one per engine block:

    engine prompt      [ 16 tokens | 16 tokens | 16 tokens | 5 ]      block_size 16, 53 tokens
    replay "tokens"    [ id(k0)    | id(k1)    | id(k2)    | tail ]   keys k0, k1, k2 as logged

so the pool is counted in engine blocks, the partial tail is never cached and the last block
of a block-aligned prompt is never a hit, as in the engine. A logged key already commits to
the request's scope (model, tokenizer, tenant), so one fixed digest stands in as block 0's parent.

Per pool size: the token hit rate; blocks evicted (LRU, as the engine evicts); and the
capacity misses: prompt tokens an unbounded cache would have served that this size had to
recompute (evicted, then needed again), priced at the per-token prefill cost. That price,
against the memory the larger pool costs, is the case for a bigger (or smaller) cache.

Requests overlap in a real server, so blocks held by running requests cannot be evicted there;
this replay has one request at a time, so at sizes near a single request's blocks it is optimistic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Protocol, Sequence

from ..cache import RadixCache, max_hit_blocks

REPLAY_SCOPE = hashlib.sha256(b"prefixserve plan capacity").digest()
_TAIL_ID = 0  # the partial tail block's "token": never matched (matches stop before it), never inserted


class LoggedRequest(Protocol):
    """What a request log entry carries (engine/request_log.RequestLogEntry has these fields)."""

    arrival_time: float
    tenant: Optional[str]
    prompt_keys: Sequence[bytes]  # the engine's chained keys of the prompt's full blocks
    num_prompt_tokens: int
    output_keys: Sequence[bytes]  # keys of the output's full blocks the engine inserted (may be empty)


class ReplayRequest(NamedTuple):
    """A request to replay when it comes from a trace or a test rather than the engine's log."""

    arrival_time: float
    tenant: Optional[str]
    prompt_keys: tuple[bytes, ...]
    num_prompt_tokens: int
    output_keys: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class CapacityResult:
    pool_blocks: int
    block_size: int  # tokens per block
    num_requests: int
    num_prompt_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int
    num_capacity_miss_tokens: int  # hits an unbounded cache would have had that this size recomputed
    num_oversized_requests: int  # needed more blocks than the pool has: computed, nothing cached
    prefill_seconds_per_token: float

    @property
    def hit_rate(self) -> float:
        """Token-weighted: prompt tokens served from cache / prompt tokens."""
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def num_evicted_tokens(self) -> int:
        return self.num_evicted_blocks * self.block_size

    @property
    def capacity_miss_seconds(self) -> float:
        """Prefill time spent recomputing what was evicted and needed again: the price of this size."""
        return self.num_capacity_miss_tokens * self.prefill_seconds_per_token

    def to_dict(self) -> dict:
        return {
            "pool_blocks": self.pool_blocks,
            "pool_tokens": self.pool_blocks * self.block_size,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.hit_rate,
            "num_evicted_blocks": self.num_evicted_blocks,
            "num_evicted_tokens": self.num_evicted_tokens,
            "num_capacity_miss_tokens": self.num_capacity_miss_tokens,
            "capacity_miss_seconds": self.capacity_miss_seconds,
            "num_oversized_requests": self.num_oversized_requests,
        }


def replay(
    requests: Iterable[LoggedRequest],
    pool_blocks: int,
    block_size: int,
    prefill_seconds_per_token: float = 0.0,
    check_integrity: bool = False,
) -> CapacityResult:
    """Replay `requests` (sorted by arrival time here) through a RadixCache of `pool_blocks` blocks."""
    if pool_blocks < 1:
        raise ValueError(f"a pool size must be at least 1 block, got {pool_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1 token, got {block_size}")
    if prefill_seconds_per_token < 0:
        raise ValueError(f"prefill_seconds_per_token must be non-negative, got {prefill_seconds_per_token}")
    cache = RadixCache(pool_blocks, block_size=1)
    ids: dict[bytes, int] = {}  # key -> its "token": equal ids <=> equal keys <=> equal prefixes
    seen: set[bytes] = set()  # every key ever inserted: the unbounded cache
    num_requests = num_prompt_tokens = num_hit_blocks = num_miss_blocks = num_oversized = 0
    for request in sorted(requests, key=lambda entry: entry.arrival_time):
        prompt_keys, output_keys = list(request.prompt_keys), list(request.output_keys)
        num_tokens = request.num_prompt_tokens
        if len(prompt_keys) > num_tokens // block_size:
            raise ValueError(
                f"a logged request has {len(prompt_keys)} prompt keys but {num_tokens} tokens hold "
                f"only {num_tokens // block_size} full blocks of {block_size}; wrong block_size?"
            )
        num_requests += 1
        num_prompt_tokens += num_tokens
        keys = prompt_keys + output_keys
        tokens = [ids.setdefault(key, len(ids) + 1) for key in keys]
        prompt_tokens = tokens[: len(prompt_keys)] + ([_TAIL_ID] if num_tokens % block_size else [])
        hit = cache.match(REPLAY_SCOPE, prompt_keys, prompt_tokens).blocks
        limit = max_hit_blocks(len(prompt_tokens), 1, len(prompt_keys))  # one "token" a block here
        unbounded = next((i for i in range(limit) if prompt_keys[i] not in seen), limit)
        seen.update(keys)
        # The blocks the engine holds: the prompt's (its tail included), which the output fills on from
        # the tail on (output block j is block len(prompt_keys) + j of the request, right after the prompt's
        # full blocks). An output's own partial tail is not logged, so it is not held here.
        num_needed = max(len(prompt_tokens), len(keys)) - len(hit)
        blocks = cache.admit(hit, num_needed)
        if blocks is None:  # more than the whole pool: the engine refuses it; it is all recomputed
            num_oversized += 1
            num_miss_blocks += unbounded
            continue
        num_hit_blocks += len(hit)
        num_miss_blocks += unbounded - len(hit)
        parent = blocks[len(hit) - 1] if hit else REPLAY_SCOPE
        for i in range(len(hit), len(keys)):
            blocks[i] = cache.insert(blocks[i], keys[i], tokens[i : i + 1], parent)
            parent = blocks[i]
        cache.release(blocks)
        if check_integrity:
            cache.check_integrity()
    return CapacityResult(
        pool_blocks,
        block_size,
        num_requests,
        num_prompt_tokens,
        num_hit_blocks * block_size,
        cache.stats.num_evicted_blocks,
        num_miss_blocks * block_size,
        num_oversized,
        prefill_seconds_per_token,
    )


def capacity_sweep(
    requests: Sequence[LoggedRequest],
    pool_sizes: Sequence[int],
    block_size: int,
    prefill_seconds_per_token: float = 0.0,
) -> list[CapacityResult]:
    """One replay per pool size (in blocks), in the order given."""
    for size in pool_sizes:
        if size < 1:
            raise ValueError(f"pool sizes must be at least 1 block, got {size} in {list(pool_sizes)}")
    return [replay(requests, size, block_size, prefill_seconds_per_token) for size in pool_sizes]


def working_set_blocks(requests: Iterable[LoggedRequest]) -> int:
    """Distinct full blocks over the log: a pool this large never evicts on this replay."""
    return len({key for request in requests for key in (*request.prompt_keys, *request.output_keys)})


def requests_from_trace(trace) -> list[ReplayRequest]:
    """A Mooncake (or agent) trace as replay requests, keyed as the simulator keys it (one block = one
    trace block of `trace.block_size` tokens; traces carry no outputs)."""
    from ..traces import block_keys  # the simulator's keys: the same hits as `prefixserve simulate`

    return [
        ReplayRequest(request.arrival_time, None, tuple(keys), request.input_length)
        for request, keys in zip(trace.requests, block_keys(trace))
    ]
