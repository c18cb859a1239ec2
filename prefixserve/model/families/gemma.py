"""Gemma 2 and Gemma 3 (text) over the Llama layer's attention and paged cache: what the family does otherwise.

    embeddings       x sqrt(hidden_size), rounded to the model's dtype first (as the reference)
    RMSNorm          x / rms(x) * (1 + w), all in float32, rounded once at the end (Llama rounds before w)
    layer            h += post_attention_norm(attention(input_norm(h)))
                     h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))
    attention        scale query_pre_attn_scalar ** -0.5; Gemma 2: scores soft-capped (the attention backends);
                     Gemma 3: q/k RMSNorm per head (the same (1 + w) norm), local (sliding-window) layers
                     rotate with their own rope base (llama.py's local_rotary)
    MLP              GeGLU: gelu_tanh(gate) * up

The local layers' sliding window is the attention backends' (attention/backend.py, csrc/paged_causal.cpp).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..attention.backend import LayerStep
from ..attention.metadata import OutputRows
from .llama import MLP, Attention, KVCache, LlamaForCausalLM, Rotary
from .model_config import ModelConfig


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, layer_index, norm_class=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv_cache: KVCache,
        step: LayerStep,
        output_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), rotary, kv_cache, step, output_rows)
        if output_rows is not None:
            x = x.index_select(0, output_rows.index)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=embedded.dtype, device=embedded.device)
        return embedded * scale
