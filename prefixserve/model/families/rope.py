"""Rotary position embeddings, rotate-half convention (as Hugging Face Llama).

The frequencies follow transformers' ``modeling_rope_utils`` exactly (same float32 ops in the
same order), because a last-bit difference in cos/sin shows up in the logits of a reference test.

Phi-3's LongRoPE has two sets of frequencies: the short ones while a sequence is at most
original_max_position_embeddings long, the long ones (for every position) once it is longer. The
table holds both, the long set at rows `long_offset` + position; the engine decides per sequence
which one it reads (runner.py), and a sequence that grows past the limit is recomputed in the long set, as
transformers recomputes it (scheduler.py). Both sets are scaled by the attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """float32 [rotary_dim // 2] inverse frequencies, including rope scaling (LongRoPE: the `long` set or the
    short one)."""
    dim = config.rotary_dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def attention_factor(config: ModelConfig) -> float:
    """LongRoPE's scale of cos and sin (transformers' default from the context extension), else 1."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position_embeddings, computed once, looked up per step.

    Only half of rotary_dim (head_dim, or Phi-4-mini's part of it) is stored: the rotate-half formula uses the
    same angle for both halves. LongRoPE's long set follows the short one, from row `long_offset`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        half = config.rotary_dim // 2
        scaling = config.rope_scaling
        self.long_offset = (
            config.max_position_embeddings if scaling is not None and scaling["rope_type"] == "longrope" else None
        )
        rows = config.max_position_embeddings * (1 if self.long_offset is None else 2)
        # Buffers follow model.to(device, dtype); transformers casts cos/sin to the activation
        # dtype too, so a bf16 model rounds them the same way. Not persistent: derived from config.
        self.register_buffer("cos", torch.empty(rows, half), persistent=False)
        self.register_buffer("sin", torch.empty(rows, half), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in place, e.g. after ``to_empty`` from the meta device."""
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.int64).float()
        sets = [False] if self.long_offset is None else [False, True]
        # float32, as transformers: angles, then cos and sin times the attention factor
        freqs = torch.cat([positions[:, None] * inverse_frequencies(self.config, long)[None, :] for long in sets])
        scale = attention_factor(self.config)
        self.cos = (freqs.cos() * scale).to(device=self.cos.device, dtype=self.cos.dtype)
        self.sin = (freqs.sin() * scale).to(device=self.sin.device, dtype=self.sin.dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] for positions [T], ready to broadcast over heads."""
        if self.cos.device.type == "meta":
            raise RuntimeError("rotary tables are on the meta device; call reset() after to_empty()")
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin
