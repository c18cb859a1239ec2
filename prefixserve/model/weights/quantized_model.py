"""A loaded float model turned into one whose weights stay quantized (quantized.py, quantized_linear.py).

    weights_from_gguf(file)   each GGUF tensor's blocks as they are (Q8_0, Q2_K-Q6_K, Q4_*, Q5_*, IQ4_*), or, for
                              another type, decoded by the format's reader and quantized to int8
    quantize_model(model, weights=..., bits=...)
                              every Linear becomes a QuantizedLinear and the embedding a
                              QuantizedEmbedding (a tied lm_head shares its weight); from the GGUF's own
                              blocks, or by quantizing the float weights (--quantize int8|int4: the
                              projections at that width, the embedding and lm_head at int8, as llama.cpp
                              keeps its output tensor wider)
    weight_memory(model)      the bytes the weights hold, and the bytes one decode step reads

The float model is loaded first (every family's weight names and fusions are the loader's), then
each float weight is dropped as its quantized layer replaces it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import torch
from torch import nn

from ..linear import Linear
from .gguf_blocks import from_gguf_blocks
from .hf_loader import LoadedModel
from .quantized import QuantizedWeight, quantize
from .quantized_linear import QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger("prefixserve.model")

KEPT_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
# Projections as the checkpoint names them, per fused layer of ours (hf_weights.py's fusions).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class WeightMemory:
    resident_bytes: int  # every weight as held in memory (a tied embedding once)
    decode_bytes: int  # what one decode step reads: every projection and lm_head, once
    kinds: tuple[str, ...]  # the formats the projections are held in

    def describe(self) -> str:
        return (
            f"weights {self.resident_bytes / 2**20:.1f} MiB resident ({', '.join(self.kinds)}); a decode step "
            f"reads {self.decode_bytes / 2**20:.1f} MiB of them ({self.decode_bytes / 1e6:.1f} MB per token "
            f"at batch 1)"
        )


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


def holds_quantized_weights(source: Path) -> bool:
    """Whether any 2-D tensor of the GGUF is quantized. A file of float weights only (an F32 or F16 export)
    is served as floats, as llama.cpp serves it, not turned into int8 here."""
    from .gguf import open_gguf

    return any(
        len(tensor.shape) == 2 and tensor.tensor_type.name not in FLOAT_GGUF_TYPES
        for tensor in open_gguf(source).tensors
    )


def weights_from_gguf(source: Path) -> dict[str, QuantizedWeight]:
    """Every 2-D weight of the GGUF under its Hugging Face name, quantized as the file holds it."""
    from .gguf import open_gguf  # the GGUF reader is imported only where a GGUF is served
    from .gguf_checkpoint import hf_config, load_tensor, plan_tensors, read_metadata, unpermute_rows

    reader = open_gguf(source)
    config = hf_config(read_metadata(reader), reader, source)
    weights: dict[str, QuantizedWeight] = {}
    requantized: set[str] = set()
    for plan in plan_tensors(reader, config, source):
        if len(plan.hf_shape) != 2:
            continue
        out_features, in_features = plan.hf_shape
        kind = plan.source.tensor_type.name
        if kind in KEPT_GGUF_TYPES:
            weight = from_gguf_blocks(kind, np.asarray(plan.source.data), out_features, in_features)
            if plan.unpermute_heads is not None:
                order = unpermute_rows(np.arange(out_features), plan.unpermute_heads)
                weight = weight.select_rows(torch.from_numpy(np.ascontiguousarray(order)))
        else:  # float tensors and the types without a kernel of their own: int8, as Q8_0 lays it out
            weight = quantize(torch.from_numpy(load_tensor(plan)), bits=8)
            requantized.add(kind)
        weights[plan.hf_name] = weight
    if requantized:
        logger.info(
            "%s: tensors of type %s are held as int8 (Q8_0 layout); %s are kept as the file has them",
            source.name,
            ", ".join(sorted(requantized)),
            ", ".join(KEPT_GGUF_TYPES),
        )
    return weights


def quantize_model(
    model: nn.Module, weights: Optional[Mapping[str, QuantizedWeight]] = None, bits: Optional[int] = None
) -> None:
    """Replace the model's Linear layers and embedding, in place, by quantized ones: from `weights`
    (Hugging Face names, e.g. weights_from_gguf's), or by quantizing the float weights to `bits`."""
    if (weights is None) == (bits is None):
        raise ValueError("quantize from the file's weights or to a bit width, one of the two")
    tied = model.config.tie_word_embeddings
    dtype = model.norm.weight.dtype
    if weights is not None:
        embedding = weights["model.embed_tokens.weight"]
        head = embedding if tied else weights["lm_head.weight"]
    else:
        embedding = quantize(model.embed_tokens.weight, bits=8)
        head = embedding if tied else quantize(model.lm_head.weight, bits=8)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or module is model.lm_head:
            continue
        parts = (
            [quantize(module.weight, bits)]
            if weights is None
            else [weights[f"model.{prefix}.weight"] for prefix in _checkpoint_names(name)]
        )
        _replace(model, name, QuantizedLinear(parts, module.bias))
    model.embed_tokens = QuantizedEmbedding(embedding, dtype)
    model.lm_head = QuantizedLinear([head])
    model.forget_decoder_stack()  # a stack built before held the float layers (or none)


def _checkpoint_names(name: str) -> tuple[str, ...]:
    """The checkpoint's projections behind our layer `name` ("layers.3.self_attn.qkv_proj")."""
    for fused, parts in _FUSED.items():
        if name.endswith(fused):
            layer = name[: -len(fused)]
            return tuple(layer + part for part in parts)
    return (name,)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def serve_quantized(loaded: LoadedModel, weights: str, gguf: Optional[Path], device: torch.device) -> LoadedModel:
    """`loaded` with its weights quantized: "gguf" (the file's own blocks), "int8" or "int4". The model
    fingerprint (part of every cache key) then names the format: quantized KV is not the float model's."""
    if device.type != "cpu":
        raise ValueError(
            f"quantized weights are served on the CPU only; on {device.type} serve the float "
            f"weights (--dequantize for a GGUF, no --quantize)"
        )
    if weights == "gguf":
        if gguf is None:
            raise ValueError("the GGUF's own quantization needs a .gguf model; give --quantize int8|int4 instead")
        quantize_model(loaded.model, weights=weights_from_gguf(gguf))
    else:
        quantize_model(loaded.model, bits={"int8": 8, "int4": 4}[weights])
    fingerprint = hashlib.sha256(f"{loaded.model_fingerprint}/weights={weights}".encode()).hexdigest()
    memory = weight_memory(loaded.model)
    logger.info("%s: %s", loaded.path.name, memory.describe())
    return replace(loaded, model_fingerprint=fingerprint)


def weight_memory(model: nn.Module) -> WeightMemory:
    """What the weights hold in memory and what a decode step reads of them (each tensor once)."""
    seen: set[int] = set()
    resident = decode = 0
    kinds: set[str] = set()

    def count(tensor: torch.Tensor) -> int:
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return tensor.untyped_storage().nbytes()

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for part in module.parts:
                resident += sum(count(tensor) for tensor in part.tensors())
                kinds.add(part.kind)
            decode += module.weight_bytes
        elif isinstance(module, QuantizedEmbedding):
            resident += sum(count(tensor) for tensor in module.weight.tensors())
        elif isinstance(module, Linear):
            read = module.packed if module.packed is not None else module.weight
            decode += read.numel() * read.element_size()
            if module.packed is not None:  # a copy of the weight in oneDNN's layout
                resident += read.numel() * read.element_size()
            kinds.add(str(read.dtype).removeprefix("torch."))
    for parameter in model.parameters():  # norms, float weights (a tied pair once), biases
        resident += count(parameter)
    return WeightMemory(resident, decode, tuple(sorted(kinds)))
