"""Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / Phi-3 decoder over a paged KV cache (Gemma 3: gemma.py).

Qwen3's per-head q/k norms and SmolLM3's layers without rotary (NoPE) are config switches here, not
families of their own: each is one step the reference adds to the same layer; Phi-3 differs only in how
its checkpoint names the weights (hf_weights.py).

Reads like the reference (transformers' modeling_llama) with these serving changes:
  * tokens are flat [T, ...] (no batch axis); sequences are told apart by AttentionMetadata,
  * q/k/v and gate/up are fused into one matmul each (load_weights maps the HF names),
  * attention writes K/V into the paged cache and reads the context back from it,
  * on CPU, `pack_linear_weights` hands float32 weights to our compiled kernel (read in place) and lays
    the others out once in oneDNN's blocked format, with calls sized so that a row's result never
    depends on its batch (linear.py),
  * the last layer attends and runs its MLP only for the rows whose outputs are used (`output_rows`:
    the sampled ones); every row's K/V is still written,
  * on CPU in float32 and bf16, RMSNorm (with the residual add before it), rotary and SiLU * up run
    as compiled kernels, one pass over memory each (kernels.rowwise_for); the PyTorch ops here are
    their reference and the fallback.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend, LayerStep
from ..attention.metadata import AttentionMetadata, OutputRows
from ..attention.paged import choose_backend, write_kv
from ..kernels import rowwise_for
from ..linear import Linear, pack_linears
from ..weights.hf_weights import load_hf_weights
from . import decoder_stack
from .model_config import ModelConfig
from .rope import RotaryEmbedding

_UNBUILT = object()  # a model's decoder stack before its first step

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, block_size, kv_heads, d]
Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of this step's positions, shared by all layers


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiled = self._kernel_for(x)
        if compiled is not None:
            return compiled.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and round to x's dtype before the weight, as the reference does,
        # with as few passes over x as possible (these tensors are [tokens, hidden]).
        if x.dtype == torch.float32:
            scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)  # the reference's ops
            return (x * scale).mul_(self.weight)
        # Lower precision: one float32 copy, normalised in place (mixed-dtype ops would convert
        # x again behind the scenes, once per op).
        x32 = x.float()
        mean_square = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_()
        x32.mul_(mean_square.div_(x.shape[-1]).add_(self.eps).rsqrt_())
        return x32.to(x.dtype).mul_(self.weight)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then this norm of x."""
        compiled = self._kernel_for(x)
        if compiled is not None and delta.is_contiguous() and delta.dtype == x.dtype:
            return compiled.add_rms_norm_(x, delta, self.weight, self.eps)
        return self(x.add_(delta))

    def _kernel_for(self, x: torch.Tensor):
        if x.dim() != 2 or x.shape[-1] % 16 or self.weight.dtype != x.dtype:
            return None
        return rowwise_for(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] as HF's apply_rotary_pos_emb does (x * [cos, cos] + rotate_half(x) * [sin, sin],
    rotate_half(x) = [-x2, x1]), with two fused multiply-adds per half and no temporaries or concatenation."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
    return out


class Attention(nn.Module):
    lora = None  # lora/step.py's LayerLoRA when the engine serves adapters: each projection's per-row updates

    def __init__(self, config: ModelConfig, layer_index: int = 0, norm_class: type = None):
        super().__init__()
        norm_class = norm_class or RMSNorm
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.softcap = config.attn_logit_softcapping  # Gemma 2 caps the scores
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.uses_rope = config.uses_rope(layer_index)  # SmolLM3's NoPE layers attend without positions
        self.rotary_dim = config.rotary_dim  # Phi-4-mini rotates the first 3/4 of each head
        self.window = config.window_of(layer_index)  # keys a row sees, None: all before it (attention/windowed.py)
        self.is_local = self.window is not None and config.local_rope_theta is not None  # Gemma 3's rope base
        # Qwen3 normalises each q and k head before the rotation (one weight per head_dim, shared by the heads)
        self.q_norm = norm_class(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_class(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv_cache: KVCache,
        step: LayerStep,
        output_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        """[T, hidden]; with `output_rows`, only those rows' [R, hidden] (every row's K/V is written)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            self.lora.apply("qkv", x, qkv)
        qk_size = self.q_size + self.kv_size
        if self.q_norm is not None:
            self._norm_heads(qkv)
        # q and k heads are adjacent columns: rotate them in one pass (half the elementwise ops).
        compiled = rowwise_for(qkv) if self.head_dim % 32 == 0 else None
        if not self.uses_rope or self.rotary_dim < self.head_dim:
            qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.uses_rope:  # the rotated part, in place; the rest of each head passes through
                qk[..., : self.rotary_dim] = rotate(qk[..., : self.rotary_dim], *rotary)
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        elif compiled is not None:  # in place, in qkv's own memory
            compiled.rotate_heads_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rotary)
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = rotate(qk, *rotary).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, step.meta.slot_mapping, step.meta.first_slot)
        if output_rows is not None:
            if output_rows.meta is None:  # nothing is sampled: this layer's K/V were all that was needed
                return x.new_empty((0, x.shape[1]))
            # Each kept row alone at its position reads the same keys as in the step (a row's sums are
            # its own on the compiled path, so its bits are too).
            out = step.backend.forward(
                q.index_select(0, output_rows.index),
                k_cache,
                v_cache,
                output_rows.meta,
                self.scale,
                window=self.window,
                softcap=self.softcap,
            )
            return self._project(out.reshape(len(output_rows.index), self.q_size))
        out = step.attend(q, k_cache, v_cache, self.scale, k, v, self.window, self.softcap)
        return self._project(out.reshape(num_tokens, self.q_size))

    def _project(self, attended: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(attended)
        if self.lora is not None:
            self.lora.apply("o", attended, out)
        return out

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each q head and each k head, written back into qkv's columns (rows stay apart)."""
        num_tokens, qk_size = qkv.shape[0], self.q_size + self.kv_size
        for norm, start, end, heads in (
            (self.q_norm, 0, self.q_size, self.num_heads),
            (self.k_norm, self.q_size, qk_size, self.num_kv_heads),
        ):
            heads_of_rows = qkv[:, start:end].reshape(num_tokens * heads, self.head_dim)
            qkv[:, start:end] = norm(heads_of_rows).view(num_tokens, end - start)


class MLP(nn.Module):
    lora = None  # as Attention's

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = config.activation  # silu, or gelu_tanh (Gemma's GeGLU)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            self.lora.apply("gate_up", x, gate_up)
        hidden = self._activate(gate_up)
        out = self.down_proj(hidden)
        if self.lora is not None:
            self.lora.apply("down", hidden, out)
        return out

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        compiled = rowwise_for(gate_up) if self.intermediate_size % 16 == 0 and self.activation == "silu" else None
        if compiled is not None:
            return compiled.silu_mul(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh").mul_(up)
        # silu writes a contiguous [T, I] that mul_ reuses: the matmul then needs no copy of a view.
        return F.silu(gate).mul_(up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv_cache: KVCache,
        step: LayerStep,
        output_rows: Optional[OutputRows] = None,
    ) -> torch.Tensor:
        # x is this step's residual stream (the embedding's output, then each layer's): updated in place.
        attended = self.self_attn(self.input_layernorm(x), rotary, kv_cache, step, output_rows)
        if output_rows is not None:
            x = x.index_select(0, output_rows.index)
        return x.add_(self.mlp(self.post_attention_layernorm.add_and_norm(x, attended)))


def is_plain_layer(layer: nn.Module) -> bool:
    """A layer of Llama's plain shape, which decoder_stack.py's compiled stack runs: these exact classes, RMSNorm,
    rotary over the whole head, no q/k norm, no window, cap or local attention, SiLU."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        type(layer) is DecoderLayer
        and type(attention) is Attention
        and type(mlp) is MLP
        and all(type(norm) is RMSNorm for norm in (layer.input_layernorm, layer.post_attention_layernorm))
        and attention.q_norm is None
        and attention.uses_rope
        and attention.rotary_dim == attention.head_dim
        and attention.window is None
        and attention.softcap is None
        and not attention.is_local
        and mlp.activation == "silu"
    )


class LlamaForCausalLM(nn.Module):
    layer_class: type = DecoderLayer  # a family's own layer and norm (gemma.py)
    norm_class: type = RMSNorm
    lora_step = None  # lora/step.py's LoRAStep when the engine serves adapters

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's local layers rotate with a rope base of their own
        self.local_rotary = (
            RotaryEmbedding(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
            if config.local_rope_theta is not None
            else None
        )
        self.layers = nn.ModuleList(self.layer_class(config, index) for index in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self._decoder_stack = _UNBUILT  # decoder_stack.py's compiled layers, built at the first step

    def has_plain_layers(self) -> bool:
        return all(is_plain_layer(layer) for layer in self.layers)

    def forget_decoder_stack(self) -> None:
        """Drop the compiled stack of the layers: call after replacing layers or their weights."""
        self._decoder_stack = _UNBUILT

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so. Call again after
        ``to_empty()``: moving off the meta device replaces each parameter separately."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def pack_linear_weights(self, batch_size_hint: int) -> bool:
        """Ready every linear weight for this CPU: our kernel or oneDNN (linear.pack_linears); True when done."""
        return pack_linears(self, self.norm.weight, batch_size_hint)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        output_rows: Optional[list[int]] = None,
        window_meta: Optional[AttentionMetadata] = None,
        attention: Optional[AttentionBackend] = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the flat tokens input_ids [T] at positions [T].

        With `output_rows` (row indices), only those rows' states [R, hidden], in that order: the last
        layer then attends and runs its MLP for them alone (a 2,020-token prompt sampling one row
        skips an eighth of the built-in model's work). Every row's K/V is written to the cache either way.
        `window_meta`, where the sliding-window layers keep their K/V in a pool of their own
        (cache/window_slots.py), is the step's metadata over that pool's slots: those layers read it.
        `attention` is the engine's backend, chosen once (ModelRunner); without it, the one choose_backend
        gives for these caches.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        last = len(self.layers) - 1
        metas = [
            window_meta if window_meta is not None and layer.self_attn.window is not None else meta
            for layer in self.layers
        ]
        kept = None
        if output_rows is not None:
            kept = OutputRows.of(metas[last], list(output_rows), kv_caches[last][0].shape[1], input_ids.device)
        x = self.embed(input_ids)
        rotary = self.rotary(positions, x.dtype)
        if attention is None:
            attention = choose_backend(kv_caches[0][0])
        if self._decoder_stack is _UNBUILT:
            self._decoder_stack = decoder_stack.build(self)
        # the compiled stack applies adapters through the LoRA kernel's slots (lora/step.py), not PyTorch's way
        adapters = self.lora_step.kernel_arguments() if self.lora_step is not None and self.lora_step.active else None
        if (
            self._decoder_stack is not None
            and adapters != ()
            and decoder_stack.can_run(x, kv_caches, output_rows, window_meta, attention)
        ):
            return self.norm(decoder_stack.run(self._decoder_stack, x, rotary, kv_caches, meta, adapters))
        local_rotary = self.local_rotary(positions, x.dtype) if self.local_rotary is not None else rotary
        steps = {}  # once per step, pool, window and cap: every layer reading the same slots the same way shares it
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            attn = layer.self_attn
            key = (id(metas[index]), attn.window, attn.softcap)
            if key not in steps:
                steps[key] = LayerStep(
                    attention, metas[index], attention.plan(metas[index], kv_cache[0], attn.window, attn.softcap)
                )
            x = layer(
                x,
                local_rotary if attn.is_local else rotary,
                kv_cache,
                steps[key],
                kept if index == last else None,
            )
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def reset_rotary(self) -> None:
        """Recompute the rotary tables, e.g. after ``to_empty()`` from the meta device."""
        for table in (self.rotary, self.local_rotary):
            if table is not None:
                table.reset()

    def plan_rows(self, batch_invariant: bool, max_rows: int, max_sampled_rows: int) -> None:
        """Every linear layer's row calls (linear.py): probed where batch invariance is asked for.
        `max_rows` is a step's token budget; lm_head sees at most `max_sampled_rows` (one per sequence)."""
        for module in self.modules():
            if hasattr(module, "plan_rows") and module is not self:  # Linear and QuantizedLinear
                module.plan_rows(batch_invariant, max_sampled_rows if module is self.lm_head else max_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab]; pass only the rows whose next token is sampled."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma: cap * tanh(logits / cap), in the model's dtype as the reference does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; checks names and shapes."""
        load_hf_weights(self, named_tensors)
        self.forget_decoder_stack()
