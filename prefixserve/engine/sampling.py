"""Turns the logits of the sequences that finished a step into next tokens."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .sampling_params import SamplingParams


class Sampler:
    """Greedy rows take one batched argmax; sampled rows get temperature, top-k, top-p and their own seed."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> list[int]:
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        for row, (param, generator) in enumerate(zip(params, generators)):
            if not param.is_greedy:
                tokens[row] = self._sample_row(logits[row].cpu(), param, generator or self._generator)
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, param: SamplingParams, generator: torch.Generator) -> int:
        logits = logits / param.temperature
        if 0 < param.top_k < logits.numel():
            threshold = torch.topk(logits, param.top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if param.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the top token always stays).
            outside = sorted_probs.cumsum(0) - sorted_probs > param.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator).item())
