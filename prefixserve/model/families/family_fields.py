"""What each served family's config.json means beyond Llama's fields: biases, q/k norms, NoPE layers, the
sliding window and its layers, and Gemma 3's activation, attention scale, local rope and logit cap
(model_config.py builds the rest). A field the engine does not compute is refused here, naming it, never
silently ignored.

    family                differs from Llama in
    Mistral, Phi-3        a sliding window on every layer (Phi-3 stores q/k/v, gate/up fused: hf_weights.py;
                          Phi-4-mini rotates part of each head, partial_rotary_factor)
    Qwen2                 q/k/v bias (not o_proj); with use_sliding_window, windows from max_window_layers on
    Qwen3                 RMSNorm on each q and k head; windows as Qwen2
    SmolLM3               layers without rotary (no_rope_layers); with use_sliding_window, those slide
    Gemma 2               GeGLU, (1 + w) RMSNorms around attention and MLP, embeddings x sqrt(hidden),
                          query_pre_attn_scalar, soft-capped attention scores and logits, every other
                          layer local (sliding)
    Gemma 3 (text)        as Gemma 2 without the attention cap, plus q/k norms, local layers (five in six)
                          with their own rope base
"""

from __future__ import annotations

from typing import Any

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
GEMMA_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}  # transformers' default: every n-th is global


def family_fields(architecture: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields in which `architecture` differs from Llama, read from config.json's `hf`."""
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "activation": _activation(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
        **_window_fields(architecture, hf),
    }
    if architecture == "Qwen2ForCausalLM":
        fields.update(attention_bias=True, o_proj_bias=False)
    elif architecture == "Qwen3ForCausalLM":
        fields["qk_norm"] = True
    elif architecture == "SmolLM3ForCausalLM":
        fields["rope_layers"] = tuple(_smollm3_rope_layers(hf))
    elif architecture == "Phi3ForCausalLM":
        fields["partial_rotary_factor"] = float(
            (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        )
    elif architecture == "Gemma2ForCausalLM":
        fields.update(_gemma2_fields(hf))
    elif architecture == "Gemma3ForCausalLM":
        fields.update(_gemma3_fields(hf))
    return fields


def _window_fields(architecture: str, hf: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and window_layers (which layers use it; () for all), as transformers reads them."""
    layers = hf["num_hidden_layers"]
    if architecture == "MistralForCausalLM":
        window = hf.get("sliding_window", 4096)
    elif architecture == "Gemma2ForCausalLM":  # transformers' Gemma2Config default
        window = hf.get("sliding_window", 4096)
    elif architecture in ("Phi3ForCausalLM", "Gemma3ForCausalLM"):
        window = hf.get("sliding_window")
    else:  # Qwen2, Qwen3, SmolLM3: off unless asked for
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None, "window_layers": ()}
    layer_types = hf.get("layer_types")
    if architecture in GEMMA_SLIDING_PATTERN and not layer_types:
        pattern = hf.get("sliding_window_pattern") or GEMMA_SLIDING_PATTERN[architecture]
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not layer_types:
        first = hf.get("max_window_layers", 28)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif architecture == "SmolLM3ForCausalLM" and not layer_types:  # its NoPE layers slide
        rope_layers = _smollm3_rope_layers(hf)
        layer_types = ["full_attention" if rope else "sliding_attention" for rope in rope_layers]
    if not layer_types or architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return {"sliding_window": int(window), "window_layers": ()}
    return {"sliding_window": int(window), "window_layers": tuple(kind == "sliding_attention" for kind in layer_types)}


def _smollm3_rope_layers(hf: dict[str, Any]) -> list[bool]:
    interval = hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]
    return [bool(flag) for flag in flags]


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"config.json hidden activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def _gemma2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields; a key config.json leaves out means transformers' Gemma2Config default."""
    return {
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
    }


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "config.json use_bidirectional_attention=true is not supported (the attention paths are "
            "causal); Gemma 3's text checkpoints attend causally"
        )
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json rope_parameters.sliding_attention of type {local['rope_type']!r} is not "
            "supported; Gemma 3's local layers use the default rotary"
        )
    return {
        "qk_norm": True,  # the window layers rotate with the local base
        "local_rope_theta": float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0),
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }
