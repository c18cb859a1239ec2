"""What each served family's config.json means beyond Llama's fields: biases, q/k norms, NoPE layers, the
sliding window, and Gemma 3's activation, attention scale, local layers and logit cap (model_config.py builds
the rest). A field the engine does not compute is refused here, naming it, never silently ignored.

    family                differs from Llama in
    Mistral, Phi-3        a sliding window (Phi-3 also stores q/k/v and gate/up fused: hf_weights.py)
    Qwen2                 q/k/v bias (not o_proj)
    Qwen3                 RMSNorm on each q and k head
    SmolLM3               layers without rotary (no_rope_layers)
    Gemma 3 (text)        GeGLU, (1 + w) RMSNorms around attention and MLP, embeddings x sqrt(hidden),
                          q/k norms, query_pre_attn_scalar, local layers with their own rope base
"""

from __future__ import annotations

from typing import Any

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA_SLIDING_PATTERN = 6  # transformers' default: every sixth Gemma 3 layer is global


def family_fields(architecture: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields in which `architecture` differs from Llama, read from config.json's `hf`."""
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = {"attention_bias": bias, "o_proj_bias": bias, "sliding_window": None,
                              "activation": _activation(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")}
    if architecture == "MistralForCausalLM":
        fields["sliding_window"] = hf.get("sliding_window", 4096)
    elif architecture in ("Phi3ForCausalLM", "Gemma3ForCausalLM"):
        fields["sliding_window"] = hf.get("sliding_window")
    elif hf.get("use_sliding_window"):  # Qwen2, Qwen3, SmolLM3: off unless asked for
        fields["sliding_window"] = hf.get("sliding_window")
    if architecture == "Qwen2ForCausalLM":
        fields.update(attention_bias=True, o_proj_bias=False)
    elif architecture == "Qwen3ForCausalLM":
        fields["qk_norm"] = True
    elif architecture == "SmolLM3ForCausalLM":
        interval = hf.get("no_rope_layer_interval", 4)
        rope_layers = hf.get("no_rope_layers") or [int((i + 1) % interval != 0)
                                                   for i in range(hf["num_hidden_layers"])]
        fields["rope_layers"] = tuple(bool(flag) for flag in rope_layers)
    elif architecture == "Phi3ForCausalLM":
        _check_whole_rotary(hf)
    elif architecture == "Gemma3ForCausalLM":
        fields.update(_gemma3_fields(hf))
    return fields


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"config.json hidden activation {name!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _check_whole_rotary(hf: dict[str, Any]) -> None:
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial} (Phi-4-mini's rotary on part of each head) "
                         "is not supported yet; Phi-3 checkpoints rotate whole heads")


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(name):
            raise ValueError(f"config.json {name}={hf[name]!r} is not supported yet (the attention kernels neither "
                             "cap scores nor attend both ways)")
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or GEMMA_SLIDING_PATTERN
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(layers)]
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention of type {local['rope_type']!r} is not "
                         "supported; Gemma 3's local layers use the default rotary")
    return {"qk_norm": True, "local_layers": tuple(kind == "sliding_attention" for kind in layer_types),
            "local_rope_theta": float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0),
            "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "final_logit_softcapping": hf.get("final_logit_softcapping")}
