"""Turns the logits of the sequences that finished a step into next tokens and their logprobs.

Numerically safe for every accepted parameter: a row whose probabilities come out non-finite
or all zero (NaN logits, +inf logits) falls back to its argmax instead of raising.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import NamedTuple, Optional, Sequence

import torch

from .outputs import TokenLogprob
from .sampling_params import SamplingParams


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprob]]  # per row; None where the request did not ask


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the draw of the token at absolute `position` of a request seeded
    with `seed`. Keyed by position, not by draw count, so a request whose prompt is another's
    prompt plus its first k outputs draws the same next tokens (a stream resumed elsewhere)."""
    packed = struct.pack("<QQ", seed % 2**64, position % 2**64)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


class Sampler:
    """Greedy rows take one batched argmax; sampled rows get temperature, top-k, top-p and a
    generator: the shared one, or one seeded from (seed, position) for a seeded request."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()

    def generator_for(self, param: SamplingParams, position: int) -> torch.Generator:
        """The generator of a draw for the token at `position`: the shared one, or one seeded from (seed,
        position) for a seeded request."""
        if param.seed is None:
            return self._generator
        return self._seeded.manual_seed(position_seed(param.seed, position))

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        raw_logits: Optional[torch.Tensor] = None,
    ) -> SamplerOutput:
        """`positions[row]`: the index in its request's token_ids where the new token will land; logprobs
        come from `raw_logits` when given (the model's, before logits_processors.py), else `logits`."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        sampled_rows = [row for row, param in enumerate(params) if not param.is_greedy]
        if sampled_rows:
            rows = logits[sampled_rows].cpu()
            for row_logits, row in zip(rows, sampled_rows):
                tokens[row] = sample_row(row_logits, params[row], self.generator_for(params[row], positions[row]))
        return SamplerOutput(tokens, compute_logprobs(logits if raw_logits is None else raw_logits, params, tokens))


def sample_row(logits: torch.Tensor, param: SamplingParams, generator: torch.Generator) -> int:
    """One draw from float32 `logits` (1-D) under the row's temperature, min-p, top-k and top-p."""
    probs = row_probs(logits, param)
    if probs is None:
        return int(logits.argmax())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def row_probs(logits: torch.Tensor, param: SamplingParams) -> Optional[torch.Tensor]:
    """The distribution a sampled row draws from (float32 `logits`, 1-D, under temperature, min-p, top-k and
    top-p); None where it comes out non-finite or all zero (the row then takes its argmax)."""
    # Shift first so the largest scaled logit is exactly 0: no overflow whatever the temperature.
    scaled = (logits - logits.max()) / param.temperature
    if param.min_p > 0.0:  # scaled is log(p / p_max) after temperature: keep p >= min_p x p_max
        scaled = scaled.masked_fill(scaled < math.log(param.min_p), float("-inf"))
    if 0 < param.top_k < scaled.numel():
        threshold = torch.topk(scaled, param.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if param.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest set whose mass reaches top_p (the top token always stays).
        outside = sorted_probs.cumsum(0) - sorted_probs > param.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        return None
    return probs


def compute_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[Optional[TokenLogprob]]:
    """Logprobs from the raw logits (log_softmax in float32), batched over the rows that asked."""
    result: list[Optional[TokenLogprob]] = [None] * len(params)
    rows = [row for row, param in enumerate(params) if param.logprobs is not None]
    if not rows:
        return result
    device = logits.device
    logprobs = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=device)).float(), dim=-1)
    chosen_ids = torch.tensor([tokens[row] for row in rows], dtype=torch.int64, device=device)
    chosen = logprobs.gather(1, chosen_ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    num_top = min(max(params[row].logprobs for row in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=1)
    chosen_list, top_values, top_ids = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    for i, row in enumerate(rows):
        k = params[row].logprobs
        top = list(zip(top_ids[i][:k], top_values[i][:k]))
        result[row] = TokenLogprob(tokens[row], chosen_list[i], ranks[i], top)
    return result
