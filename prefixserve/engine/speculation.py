"""Prompt-lookup speculation (vLLM's "ngram" method) that never changes a token.

Each step, a decoding request that may speculate gets up to k draft tokens: those that followed the latest earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min; `NgramIndex` keeps each
request's n-grams, so a lookup is a dict read). The step computes the request's last token and its drafts as one
chunk of k + 1 rows, and samples every row: row j is the token that would follow the last token and the first j
drafts. The compiled kernels give each row the bits it has alone in a decode step (a row's sums are its own
whatever else is in the step: the batch invariance the cache already rests on), so greedy row j is exactly the
token a plain decode would choose there. `accept` keeps row 0's token and each next row's while the draft before
it was that token (the runner decides, engine/runner.py); the scheduler then appends the kept tokens one at a time,
as single steps would, stopping where a stop condition does. A rejected draft's K/V lies past the request's
computed tokens: never read (a row reads keys up to its own position), overwritten by the next step, never
inserted in the radix or a tier.

A sampled request's drafts are verified by speculative sampling (verify_sampled): its kept tokens follow the
target model's distribution, though not the draws a plain run would make.

Who speculates: requests whose next-token choice does not depend on earlier outputs beyond the tokens themselves
(no penalties, bad words, grammar, pending min_tokens). Stop strings are read after each kept token (the engine's
detokenizer, through Scheduler.stop_string), so an output ends on the token that completes one, as without drafts.
The rest of the batch decodes as usual in the same step. A request stops
drafting once its drafts keep too few tokens to pay for their rows (measured per request: MIN_ACCEPTED), and no
request drafts in a step with more than MAX_BATCH running: there a step is bound by compute, not by reading the
weights, and verifying drafts costs more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..speculative_config import SpeculativeConfig
from .logits_processors import num_generated
from .request import Request

MAX_BATCH = 8  # running requests above which no request drafts
# A request whose drafts keep fewer than MIN_ACCEPTED tokens each, on average over its first PROBATION drafts or
# more, stops drafting: a verifying step of up to 4 rows costs about 1.5x a one-row decode step (SmolLM2 Q4_1, AMD
# EPYC Zen 4; the quantized matmul reads the weights once for up to 4 rows), so fewer do not pay for it.
MIN_ACCEPTED = 0.5
PROBATION = 4


class NgramIndex:
    """For each n in [shortest, longest], each n-gram of a sequence -> where its latest occurrence ends, over the
    tokens before the last one (so the last n tokens' own occurrence is never its own match)."""

    def __init__(self, shortest: int, longest: int) -> None:
        self.sizes = range(shortest, longest + 1)
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at or before this position are in `ends`

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the latest earlier occurrence of the sequence's longest suffix
        found (n from longest down); [] when none recurs."""
        limit = len(token_ids) - 1
        for end in range(self.indexed + 1, limit + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends[tuple(token_ids[end - n : end])] = end
        self.indexed = max(self.indexed, limit)
        for n in reversed(self.sizes):
            if len(token_ids) > n:
                end = self.ends.get(tuple(token_ids[-n:]))
                if end is not None:
                    return token_ids[end : end + num_tokens]
        return []


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts proposed, draft tokens, accepted draft tokens, accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class RequestDrafts:
    """One request's n-gram index and its drafts' record."""

    index: NgramIndex
    drafts: int = 0
    accepted: int = 0  # draft tokens accepted


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        self._requests: dict[str, RequestDrafts] = {}

    def draft(self, request: Request, num_running: int, budget: int, long_rope_after=None, window_slots=None):
        """The draft for a request about to decode (its last token not yet computed), within the step's token
        budget; never across the LongRoPE switch (a draft must not make the request recompute with long factors
        earlier than one token at a time would) nor with window pools (whose blocks slide one step at a time)."""
        if request.num_tokens - request.num_computed_tokens != 1 or window_slots is not None:
            return []
        room = budget - 1
        if long_rope_after is not None and not request.long_rope:
            room = min(room, long_rope_after - request.num_tokens)
        if num_running > MAX_BATCH or room <= 0 or not may_speculate(request):
            return []
        own = self._requests.get(request.request_id)
        if own is None:
            config = self.config
            own = self._requests[request.request_id] = RequestDrafts(
                NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            )
        if own.drafts >= PROBATION and own.accepted < MIN_ACCEPTED * own.drafts:
            return []
        left = request.sampling_params.max_tokens - request.num_output_tokens - 1  # the last token's row adds one
        return own.index.propose(request.token_ids, min(self.config.num_speculative_tokens, room, left))

    def record(self, request: Request, draft: list[int], kept: list[int]) -> None:
        """A verified draft: `kept` the tokens its step keeps (the accepted drafts, then one more)."""
        own = self._requests.get(request.request_id)
        if own is not None:
            own.drafts += 1
            own.accepted += len(kept) - 1
        self.stats.record(len(draft), len(kept) - 1)

    def forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)


def verify_sampled(probs: list, argmax: list[int], draft: list[int], generator_of) -> list[int]:
    """Speculative sampling (Leviathan et al.; vLLM's rejection sampler) for a draft proposed with certainty, as
    prompt lookup proposes: draft[j] is kept with probability p_j(draft[j]); where it is not, the token is drawn
    from p_j without it (renormalised) and the step ends; after every draft kept, one more is drawn from p_k. The
    kept tokens are distributed as the target model's own draws. probs[j]: row j's distribution (sampling.py's
    row_probs; None where the row takes its argmax, argmax[j]); generator_of(j): the generator of row j's draw."""
    kept = []
    for j, token in enumerate(draft):
        if probs[j] is None:
            kept.append(argmax[j])
            if argmax[j] != token:
                return kept
            continue
        generator = generator_of(j)
        if float(torch.rand((), generator=generator)) < float(probs[j][token]):
            kept.append(token)
            continue
        residual = probs[j].clone()
        residual[token] = 0.0
        kept.append(int(torch.multinomial(residual, 1, generator=generator).item()))
        return kept
    last = len(draft)
    if probs[last] is None:
        kept.append(argmax[last])
    else:
        kept.append(int(torch.multinomial(probs[last], 1, generator=generator_of(last)).item()))
    return kept


def accept(draft: list[int], sampled: list[int]) -> list[int]:
    """sampled[j] follows the last token and draft[:j]: keep sampled[0], then sampled[j] while draft[j - 1] was
    sampled[j - 1]."""
    kept = sampled[:1]
    for j, token in enumerate(draft):
        if token != sampled[j]:
            break
        kept.append(sampled[j + 1])
    return kept


def may_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (
        request.grammar is None
        and not params.presence_penalty
        and not params.frequency_penalty
        and params.repetition_penalty == 1.0
        and not request.bad_words_token_ids
        and num_generated(request) >= params.min_tokens
    )
