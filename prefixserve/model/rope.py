"""Rotary position embeddings, rotate-half convention (as Hugging Face Llama).

The frequencies follow transformers' ``modeling_rope_utils`` exactly (same float32 ops in the
same order), because a last-bit difference in cos/sin shows up in the logits of a reference test.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, including rope scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position_embeddings, computed once, looked up per step.

    Only half of head_dim is stored: the rotate-half formula uses the same angle for both halves.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        half = config.head_dim // 2
        # Buffers follow model.to(device, dtype); transformers casts cos/sin to the activation
        # dtype too, so a bf16 model rounds them the same way. Not persistent: derived from config.
        self.register_buffer("cos", torch.empty(config.max_position_embeddings, half), persistent=False)
        self.register_buffer("sin", torch.empty(config.max_position_embeddings, half), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in place, e.g. after ``to_empty`` from the meta device."""
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inverse_frequencies(self.config)[None, :]  # float32, as transformers
        self.cos = freqs.cos().to(device=self.cos.device, dtype=self.cos.dtype)
        self.sin = freqs.sin().to(device=self.sin.device, dtype=self.sin.dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] for positions [T], ready to broadcast over heads."""
        if self.cos.device.type == "meta":
            raise RuntimeError("rotary tables are on the meta device; call reset() after to_empty()")
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin

