"""A waiting request lets others pass while a running one computes the prefix they share (in-batch sharing).

Thirty-two requests that arrive together on one uncached 1,500-token few-shot prompt would otherwise be
admitted side by side while the first of them computes that prompt: each later one whose turn comes in
the same step (or before the first has finished its chunks) computes the same blocks again, since nothing
is cached yet. Such a request instead waits: the blocks are in the cache the step after the producer
writes them, and the request is then admitted as a hit. SGLang's scheduler does the same (it puts a
waiting request behind the others when a request of the batch being formed shares its prefix).

A request waits only for a producer that is running, still has at least IN_FLIGHT_MIN_TOKENS of the shared
blocks to compute, and will cache them (not cache_retention "none"). Running requests are scheduled before
any waiting one, so the producer moves on every step and the wait ends; one that is preempted is no longer
running, and nobody waits for it. Keys are chained per scope, so equal keys at a block mean the same model,
tenant and tokens up to it: nobody waits on another tenant's prompt.
"""

from __future__ import annotations

from typing import Iterable

from .request import Request

IN_FLIGHT_MIN_TOKENS = 32  # below this, computing the blocks twice costs less than a step's wait


def waits_for_in_flight(request: Request, num_hit_blocks: int, running: Iterable[Request], block_size: int) -> bool:
    """True when a running request will compute at least IN_FLIGHT_MIN_TOKENS of `request`'s prompt past
    its cached `num_hit_blocks` that nobody has computed yet. `request.block_keys` must be extended over
    its prompt (the scheduler's match does that)."""
    keys = request.block_keys
    num_blocks = -(-IN_FLIGHT_MIN_TOKENS // block_size)
    for producer in running:
        if producer is request or producer.cache_retention == "none":
            continue
        # the producer's first block still to compute: blocks before it are cached (inserted after each step)
        first = max(num_hit_blocks, producer.num_computed_tokens // block_size)
        last = first + num_blocks - 1  # the shared run must reach this block; chained keys: then all before it
        other = producer.block_keys
        if last < len(keys) and last < len(other) and keys[last] == other[last]:
            return True
    return False
