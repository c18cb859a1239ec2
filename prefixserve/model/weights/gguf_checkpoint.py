"""A GGUF file read as a Hugging Face checkpoint: its config.json and its tensors in float32.

llama.cpp's converter changes three things on the way into a GGUF; each is undone here:

    names   token_embd.weight, blk.N.attn_q.weight, ...  ->  model.embed_tokens.weight,
            model.layers.N.self_attn.q_proj.weight, ...  (see _LAYER_NAMES)
    shapes  ggml lists dimensions fastest first ([in, out]); torch lists them [out, in]
    rows    for llama, the rows of Q and K (and their biases) are reordered within each head,
            so that the two halves of a rotary pair sit next to each other:

                Hugging Face (pairs i, i + d/2):  0 1 2 3 | 4 5 6 7
                GGUF         (pairs 2i, 2i + 1):  0 4 1 5 2 6 3 7     (one head, head_dim d = 8)

The tensors are decoded by the format's reference reader, ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

Q = GGMLQuantizationType
# Each one is checked against an independent decode in tests/test_model_gguf.py.
SUPPORTED_TENSOR_TYPES = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q8_0,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ4_NL,
    Q.IQ4_XS,
    Q.IQ3_S,
    Q.IQ3_XXS,
    Q.IQ2_S,
    Q.IQ2_XS,
    Q.IQ2_XXS,
    Q.IQ1_S,
    Q.IQ1_M,
)


@dataclass(frozen=True)
class Architecture:
    hf_architecture: str
    model_type: str
    permutes_qk: bool  # llama.cpp reorders the Q/K rows (see the module docstring)
    layer_tensors: tuple[str, ...] = ()  # GGUF layer tensors it needs beyond Llama's


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", permutes_qk=True),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", permutes_qk=False),
    "qwen3": Architecture(
        "Qwen3ForCausalLM", "qwen3", permutes_qk=False, layer_tensors=("attn_q_norm.weight", "attn_k_norm.weight")
    ),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# required only where an Architecture's layer_tensors names them
_FAMILY_LAYER_NAMES = {name for architecture in ARCHITECTURES.values() for name in architecture.layer_tensors}
_REQUIRED_LAYER_NAMES = [name for name in _LAYER_NAMES if name.endswith(".weight") and name not in _FAMILY_LAYER_NAMES]
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_IGNORED = re.compile(r"blk\.\d+\.attn_rot_embd")  # an old precomputed rotary table, never a weight


@dataclass(frozen=True)
class TensorPlan:
    """Where one GGUF tensor goes: its Hugging Face name and shape, and how to undo the Q/K
    row order (the number of heads to regroup by, or None)."""

    hf_name: str
    hf_shape: tuple[int, ...]
    source: ReaderTensor
    unpermute_heads: int | None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field as a Python value (str, int, float, bool or list)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def architecture_of(metadata: dict[str, Any], source: Path) -> Architecture:
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {name!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (convert the original checkpoint instead, or use a GGUF of one of these)"
        )
    return ARCHITECTURES[name]


def hf_config(metadata: dict[str, Any], reader: GGUFReader, source: Path) -> dict[str, Any]:
    """config.json for the checkpoint, from the metadata (hyperparameters) and the tensor list
    (vocabulary size, tied embeddings, attention bias)."""
    architecture = architecture_of(metadata, source)
    prefix = metadata["general.architecture"]

    def get(key: str) -> Any:
        value = metadata.get(f"{prefix}.{key}")
        if value is None:
            raise ValueError(f"{source}: GGUF metadata lacks {prefix}.{key}; the file is incomplete")
        return value

    if int(metadata.get("split.count", 1)) > 1:
        raise ValueError(
            f"{source} is one part of a split GGUF; merge the parts first with "
            f"`llama-gguf-split --merge FIRST_PART.gguf merged.gguf`"
        )
    names = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{source}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 style "
            f"rope scaling) are not supported yet"
        )
    if metadata.get(f"{prefix}.rope.scaling.type", "none") not in ("none", "linear"):
        raise ValueError(
            f"{source}: rope scaling {metadata[f'{prefix}.rope.scaling.type']!r} is not "
            f"supported; supported: none, linear"
        )
    if "token_embd.weight" not in names:
        raise ValueError(f"{source}: no token_embd.weight tensor; the file is incomplete")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(metadata.get(f"{prefix}.attention.key_length") or hidden // heads)
    rotary_dim = int(metadata.get(f"{prefix}.rope.dimension_count") or head_dim)
    if rotary_dim != head_dim:
        raise ValueError(
            f"{source}: partial rotary embeddings (rope.dimension_count={rotary_dim}, "
            f"head_dim={head_dim}) are not supported"
        )
    config: dict[str, Any] = {
        "architectures": [architecture.hf_architecture],
        "model_type": architecture.model_type,
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{prefix}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        # GGUF stores float32: 1e-5 arrives as 9.99999974e-06. Its shortest float32 spelling is
        # the same number in float32 arithmetic and reads as the original config did.
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(metadata.get(f"{prefix}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    if metadata.get(f"{prefix}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _float32(get("rope.scaling.factor"))}
    if architecture.model_type in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            config[key] = int(metadata[f"tokenizer.ggml.{key}"])
    return config


def plan_tensors(reader: GGUFReader, config: dict[str, Any], source: Path) -> list[TensorPlan]:
    """Every tensor of the file, named and shaped for Hugging Face, in a fixed (name) order."""
    permutes = ARCHITECTURES[config["model_type"]].permutes_qk
    plans = []
    for tensor in reader.tensors:
        if _IGNORED.fullmatch(tensor.name):
            continue
        hf_name = _hf_name(tensor.name, source)
        heads = None
        if permutes and ".self_attn.q_proj." in hf_name:
            heads = config["num_attention_heads"]
        elif permutes and ".self_attn.k_proj." in hf_name:
            heads = config["num_key_value_heads"]
        shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
        plans.append(TensorPlan(hf_name, shape, tensor, heads))
    _check_complete({plan.hf_name for plan in plans}, config, source)
    return sorted(plans, key=lambda plan: plan.hf_name)


def load_tensor(plan: TensorPlan) -> np.ndarray:
    """The tensor dequantized to float32, in Hugging Face layout (C-contiguous)."""
    tensor = plan.source
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which prefixserve cannot "
            f"convert; supported: {', '.join(kind.name for kind in SUPPORTED_TENSOR_TYPES)} "
            f"(re-quantize the original with llama.cpp's llama-quantize to one of these)"
        )
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    if values.size != int(np.prod(plan.hf_shape)):
        raise ValueError(
            f"tensor {tensor.name!r} holds {values.size} values, its shape "
            f"{plan.hf_shape} needs {int(np.prod(plan.hf_shape))}; the file is corrupt"
        )
    values = values.reshape(plan.hf_shape)
    if plan.unpermute_heads is not None:
        values = unpermute_rows(values, plan.unpermute_heads)
    return np.ascontiguousarray(values)


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` (convert_hf_to_gguf.py): within each head, rows
    (0, d/2, 1, d/2 + 1, ...) go back to (0, 1, ..., d - 1). Works for a weight or a bias."""
    half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _hf_name(name: str, source: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(
        f"{source}: tensor {name!r} has no Hugging Face counterpart in the supported "
        f"architectures ({', '.join(ARCHITECTURES)})"
    )


def _check_complete(hf_names: set[str], config: dict[str, Any], source: Path) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    required = _REQUIRED_LAYER_NAMES + list(ARCHITECTURES[config["model_type"]].layer_tensors)
    for index in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{index}.{_LAYER_NAMES[name]}" for name in required}
    missing = sorted(expected - hf_names)
    if missing:
        raise ValueError(
            f"{source}: missing {len(missing)} tensors (e.g. {', '.join(missing[:3])}); "
            f"the file is incomplete or block_count is wrong"
        )
    extra_layers = sorted(
        name
        for name in hf_names
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= config["num_hidden_layers"]
    )
    if extra_layers:
        raise ValueError(
            f"{source}: tensor {extra_layers[0]} is beyond block_count="
            f"{config['num_hidden_layers']}; the metadata is wrong"
        )


def _float32(value: Any) -> float:
    return float(str(np.float32(value)))
