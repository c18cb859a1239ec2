"""Which Hugging Face tensor fills which view of our parameters, family by family, and the copy that checks it.

Our layers fuse q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (one matmul each). Most
families store them apart (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`), each filling a row range
of the fused weight; Phi-3 stores them fused already, in our order (q, k, v; gate, up):

    qkv_proj.weight      rows [0, q)          [q, q + kv)        [q + kv, q + 2 kv)
                              q_proj               k_proj              v_proj
    gate_up_proj.weight  rows [0, I)          [I, 2 I)
                              gate_proj            up_proj
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from ..families.llama import LlamaForCausalLM

FUSED_ON_DISK = ("Phi3ForCausalLM",)  # families whose checkpoints store qkv_proj and gate_up_proj


def load_hf_weights(model: "LlamaForCausalLM", named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into the model's (fused) parameters; checks names and shapes."""
    config = model.config
    targets = hf_targets(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in targets:
                if _is_ignorable(name):
                    continue
                raise ValueError(
                    f"unexpected tensor {name!r} in checkpoint: this {config.architecture} "
                    f"(layers={config.num_hidden_layers}, biases: qkv={config.attention_bias}, "
                    f"o={config.o_proj_bias}, mlp={config.mlp_bias}, q/k norms={config.qk_norm}) has no such parameter"
                )
            destination = targets[name]
            if tuple(tensor.shape) != tuple(destination.shape):
                raise ValueError(
                    f"shape mismatch for {name!r}: expected {tuple(destination.shape)} from "
                    f"config.json, checkpoint has {tuple(tensor.shape)}"
                )
            destination.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if config.tie_word_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def hf_targets(model: "LlamaForCausalLM") -> dict[str, torch.Tensor]:
    """HF parameter name -> the view of our parameter it fills."""
    config = model.config
    targets: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
        # Some tied checkpoints still ship lm_head.weight; it is the same tensor.
        "lm_head.weight": model.embed_tokens.weight if config.tie_word_embeddings else model.lm_head.weight,
    }
    fused_on_disk = config.architecture in FUSED_ON_DISK
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        attn, mlp = layer.self_attn, layer.mlp
        if fused_on_disk:
            _expose(targets, f"{prefix}self_attn.qkv_proj", attn.qkv_proj)
            _expose(targets, f"{prefix}mlp.gate_up_proj", mlp.gate_up_proj)
        else:
            q_size, kv_size = attn.q_size, attn.kv_size
            for hf_name, start, size in (
                ("q_proj", 0, q_size),
                ("k_proj", q_size, kv_size),
                ("v_proj", q_size + kv_size, kv_size),
            ):
                _expose(targets, f"{prefix}self_attn.{hf_name}", attn.qkv_proj, start, size)
            size = config.intermediate_size
            for hf_name, start in (("gate_proj", 0), ("up_proj", size)):
                _expose(targets, f"{prefix}mlp.{hf_name}", mlp.gate_up_proj, start, size)
        _expose(targets, f"{prefix}self_attn.o_proj", attn.o_proj)
        _expose(targets, f"{prefix}mlp.down_proj", mlp.down_proj)
        if attn.q_norm is not None:
            targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight
            targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight
        for name, norm in layer.named_children():  # input and post-attention; Gemma's feed-forward pair too
            if name.endswith("_layernorm"):
                targets[f"{prefix}{name}.weight"] = norm.weight
    return targets


def _expose(
    targets: dict[str, torch.Tensor], hf_name: str, linear: nn.Linear, start: int = 0, size: Optional[int] = None
) -> None:
    """Map an HF projection's weight (and bias) onto rows [start, start + size) of a (fused) linear."""
    size = linear.weight.shape[0] if size is None else size
    targets[f"{hf_name}.weight"] = linear.weight.narrow(0, start, size)
    if linear.bias is not None:
        targets[f"{hf_name}.bias"] = linear.bias.narrow(0, start, size)


def _is_ignorable(name: str) -> bool:
    # Old checkpoints store the rotary inverse frequencies; we recompute them from the config.
    return name.endswith("rotary_emb.inv_freq")
