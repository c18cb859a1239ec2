"""A LoRA adapter as llama.cpp's convert_lora_to_gguf.py writes it, and as `llama-server --lora FILE` reads it:
a GGUF whose `general.type` is "adapter" and `adapter.type` "lora", with `adapter.lora.alpha`, and for each
adapted base tensor NAME (blk.N.attn_q.weight, ...) the pair NAME.lora_a [r, in] and NAME.lora_b [out, r] (ggml
lists dimensions fastest first, so its shapes read [in, r] and [r, out]). As llama.cpp scales it, an update is
B @ A times alpha / r (times 1 where alpha is 0). For the llama architecture the converter reorders the rows of
q and k (the base weight's rotary pairs, model/weights/gguf_checkpoint.py); it does so to lora_b, whose rows are
the weight's, and they are put back here. What llama.cpp applies beside the projections (norms a merge tool
kept, token embeddings, aLoRA's invocation tokens) is refused, naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .adapter_error import AdapterError

# GGUF tensor name (after blk.N.) -> PEFT module name
_MODULES = {
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_qkv.weight": "qkv_proj",  # Phi-3
    "attn_output.weight": "o_proj",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",  # Phi-3's fused gate and up when twice the intermediate size
    "ffn_down.weight": "down_proj",
}
_TENSOR = re.compile(r"blk\.(\d+)\.(\w+\.weight)\.lora_([ab])")
# GGUF architecture -> (the base architectures it adapts, whether the converter reordered q and k rows)
_ARCHITECTURES = {
    "llama": ({"LlamaForCausalLM", "MistralForCausalLM"}, True),
    "smollm3": ({"SmolLM3ForCausalLM"}, True),
    "qwen2": ({"Qwen2ForCausalLM"}, False),
    "qwen3": ({"Qwen3ForCausalLM"}, False),
    "gemma2": ({"Gemma2ForCausalLM"}, False),
    "gemma3": ({"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"}, False),
    "phi3": ({"Phi3ForCausalLM"}, False),
}


def read_gguf_adapter(name: str, path: Path, config):
    """(PEFT module's (layer, name) -> {"A", "B"} in PEFT's layouts, rank -> scaling) of a GGUF LoRA file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a readable GGUF file ({error})") from None
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise AdapterError(
            f"LoRA adapter {name!r}: {path} is a GGUF but not a LoRA adapter (general.type "
            f"{fields.get('general.type')!r}, adapter.type {fields.get('adapter.type')!r}): convert the PEFT "
            "directory with llama.cpp's convert_lora_to_gguf.py, or serve the directory itself"
        )
    if fields.get("adapter.alora.invocation_tokens"):
        raise AdapterError(f"LoRA adapter {name!r}: an activated LoRA (aLoRA invocation tokens) is not served")
    architecture = fields.get("general.architecture")
    bases, reordered = _ARCHITECTURES.get(architecture, (set(), False))
    if not bases & set(config.architectures):
        raise AdapterError(
            f"LoRA adapter {name!r}: {path} adapts a {architecture!r} model, the base is "
            f"{', '.join(config.architectures)}: an adapter for another base model?"
        )
    alpha = float(fields.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, GGUF tensor name) -> {"A", "B"}
    for tensor in reader.tensors:
        matched = _TENSOR.fullmatch(tensor.name)
        if matched is None or matched.group(2) not in _MODULES:
            raise AdapterError(
                f"LoRA adapter {name!r}: tensor {tensor.name!r} is not a LoRA pair of a projection this server "
                f"adapts (blk.N.{{{', '.join(sorted(_MODULES))}}}.lora_a / .lora_b)"
            )
        shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
        try:
            values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32").reshape(shape))
        except (NotImplementedError, ValueError) as error:
            raise AdapterError(f"LoRA adapter {name!r}: cannot decode {tensor.name!r} ({error})") from None
        pairs.setdefault((int(matched.group(1)), matched.group(2)), {})[matched.group(3).upper()] = values
    found = {}
    for (layer, tensor_name), pair in pairs.items():
        module = _MODULES[tensor_name]
        if module == "up_proj" and "B" in pair and pair["B"].shape[0] == 2 * config.intermediate_size:
            module = "gate_up_proj"
        found[layer, module] = pair
    if not found:
        raise AdapterError(f"LoRA adapter {name!r}: {path} holds no lora_a / lora_b tensors")
    if reordered:
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for (_, module), pair in found.items():
            if module in heads and "B" in pair:
                pair["B"] = _restore_rows(pair["B"], heads[module])
    return found, (lambda rank: alpha / rank if alpha else 1.0)


def _restore_rows(b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's reordering of a q or k weight's rows within each head (pairs 2i, 2i + 1 back to
    i, i + d/2), on lora_b's rows."""
    half = b.shape[0] // num_heads // 2
    return b.reshape(num_heads, half, 2, b.shape[1]).transpose(1, 2).reshape(b.shape).contiguous()
