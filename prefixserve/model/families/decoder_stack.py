"""Every decoder layer of a step in one compiled call (csrc/decoder_stack.cpp), where the model allows it.

A batch-1 decode step of SmolLM2 with quantized weights spends about 6 ms in kernels and 2 ms in the
Python around them: some 400 calls (five matmuls, two norms, rotary, the KV write and attention per
layer, over 30 layers) of a few microseconds each. The compiled stack runs the same kernels in the same
order on the same operands, so its bits are llama.py's (tests/test_model_decoder_stack.py); it only
takes the calls out of Python.

It runs where llama.py's layer would take exactly those kernels and nothing else:
  * an engine whose attention backend is the compiled kernel (attention/compiled.py) with its row-wise
    kernels, float32 activations and KV cache, on the CPU;
  * plain Llama layers (DecoderLayer, Attention, MLP, RMSNorm, not a family's subclass): rotary over
    the whole head, no per-head q/k norm, no sliding window, no score cap, SiLU;
  * every projection a QuantizedLinear or a float32 Linear our kernel multiplies (linear.py's use_kernel;
    bf16 and oneDNN-packed Linear layers run from Python);
  * a step whose every row's output is used (no `output_rows`) and one KV pool (no window pool);
  * LoRA adapters through the LoRA kernel's slots (lora/step.py), or none.
Anything else keeps the layer-by-layer path, which stays the reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ..attention.backend import AttentionBackend
from ..attention.compiled import CompiledAttention
from ..attention.metadata import AttentionMetadata
from ..linear import Linear
from ..weights.quantized_linear import QuantizedLinear

ENABLED = True  # tests switch it off to compare against the layer-by-layer path


def _projection(layer) -> tuple:
    if isinstance(layer, Linear):  # a float32 weight our kernel reads in place (linear.py's use_kernel)
        return ([layer.kernel_weight], layer.kernel_bias)
    return ([part.kernel_arguments() for part in layer.parts], layer.bias)


def _compiled_projection(layer) -> bool:
    return isinstance(layer, QuantizedLinear) or (isinstance(layer, Linear) and layer.kernel_weight is not None)


def _fits_kernel(layer) -> bool:
    """What the compiled stack needs of a plain Llama layer (the model says which layers are plain): projections
    our kernels run, float32 norms on the CPU, head sizes and widths the kernel's tiles divide."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        all(norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu" for norm in norms)
        and all(_compiled_projection(projection) for projection in projections)
        and attention.head_dim % 32 == 0
        and mlp.intermediate_size % 16 == 0
    )


def build(model) -> Optional[object]:
    """The compiled stack of the model's layers, or None where it cannot run them (see the module's doc)."""
    compiled = kernels.compiled
    if compiled is None or not compiled.has_rowwise or compiled.decoder_stack is None:
        return None
    layers = list(model.layers)
    if not layers or not model.has_plain_layers() or not all(_fits_kernel(layer) for layer in layers):
        return None
    if model.config.hidden_size % 16:
        return None
    attention = layers[0].self_attn
    specs = [
        (
            layer.input_layernorm.weight.detach(),
            layer.input_layernorm.eps,
            _projection(layer.self_attn.qkv_proj),
            _projection(layer.self_attn.o_proj),
            layer.post_attention_layernorm.weight.detach(),
            layer.post_attention_layernorm.eps,
            _projection(layer.mlp.gate_up_proj),
            _projection(layer.mlp.down_proj),
        )
        for layer in layers
    ]
    return compiled.decoder_stack(
        specs,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        model.config.hidden_size,
        layers[0].mlp.intermediate_size,
        attention.scale,
    )


def can_run(x: torch.Tensor, kv_caches: list, output_rows, window_meta, attention: AttentionBackend) -> bool:
    """Whether this step fits the stack (the model already does): the engine's attention is the compiled kernel
    the stack runs inside, every row's output is used, one pool, float32 on the CPU."""
    k_cache = kv_caches[0][0]
    return (
        ENABLED
        and isinstance(attention, CompiledAttention)
        and output_rows is None
        and window_meta is None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and k_cache.dtype == torch.float32
        and k_cache.device.type == "cpu"
    )


def run(
    stack,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list,
    meta: AttentionMetadata,
    adapters: Optional[tuple] = None,
) -> torch.Tensor:
    """x after every layer (updated in place), as the layer-by-layer loop gives it; `adapters`: the step's LoRA
    slots and each row's slot (lora/step.py's kernel_arguments), None without."""
    cos, sin = rotary
    lora, slot_of_row = adapters if adapters is not None else (None, None)
    return stack.run(
        x,
        cos,
        sin,
        [cache[0] for cache in kv_caches],
        [cache[1] for cache in kv_caches],
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        meta.slot_mapping,
        lora,
        slot_of_row,
    )
