"""A LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors), checked against its base.

Each adapted module's update is B @ A scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as
peft's LoraLayer applies it. Our layers fuse q/k/v into one qkv projection and gate/up into gate_up, so an
update to q_proj is a column range of the fused output; Phi-3's adapters, saved against its fused qkv_proj
and gate_up_proj, cover the whole range. The adapter's fingerprint is a digest of what it computes (every
tensor and scale, never its name or path): it enters the cache scope, so two adapters never share a block,
the same weights under two names do, and a name reloaded with new weights reads none of the old blocks.

What cannot be served exactly is refused at load, naming the cause: a missing file, a pickled
adapter_model.bin, a target outside the attention and MLP projections, a shape the base does not have, a
rank past max_lora_rank, NaN or infinity, and PEFT options that change the arithmetic (DoRA, trained biases,
modules_to_save, per-module rank or alpha patterns).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter_error import AdapterError

# PEFT's module name -> (our fused module, the part of its output it updates; None: all of it)
TARGETS = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "qkv_proj": ("qkv", None),  # Phi-3
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "gate_up_proj": ("gate_up", None),  # Phi-3
    "down_proj": ("down", None),
}
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora) rescales the base weight's columns",
    "modules_to_save": "modules_to_save replaces whole modules of the base",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout)",
}


@dataclass(frozen=True)
class FusedUpdate:
    """Every adapted part of one fused projection in one layer, as one update: out += (x @ a.T @ b.T) * scaling,
    where a stacks the parts' A ([sum of r, in]) and b places each part's B at its output columns and its A's
    rows ([out, sum of r], zero elsewhere: a column no part adapts gains exactly 0). Per part that is peft's
    (x @ A.T @ B.T) * scaling; one matmul pair serves q, k and v (or gate and up) at once. `parts` names each
    part's block of b, (first row of a, rank, first output column, columns): what the kernel reads of it."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    parts: tuple[tuple[int, int, int, int], ...]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    fingerprint: str  # hex digest of every tensor and scale: the cache scope's adapter_id
    layers: list[dict[str, FusedUpdate]] = field(default_factory=list)  # per layer: fused module -> its update


def output_ranges(config) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module name -> (fused module, first output column, columns, input features) for this base."""
    q, kv, hidden, inter = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
        config.hidden_size,
        config.intermediate_size,
    )
    return {
        "q_proj": ("qkv", 0, q, hidden),
        "k_proj": ("qkv", q, kv, hidden),
        "v_proj": ("qkv", q + kv, kv, hidden),
        "qkv_proj": ("qkv", 0, q + 2 * kv, hidden),
        "o_proj": ("o", 0, hidden, q),
        "gate_proj": ("gate_up", 0, inter, hidden),
        "up_proj": ("gate_up", inter, inter, hidden),
        "gate_up_proj": ("gate_up", 0, 2 * inter, hidden),
        "down_proj": ("down", 0, hidden, inter),
    }


def load_adapter(name: str, path: str, config, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for the base `config`: a PEFT directory, or a GGUF LoRA file as llama.cpp's
    convert_lora_to_gguf.py writes it (gguf_adapter.py); AdapterError names what is wrong."""
    if Path(path).is_file():
        from .gguf_adapter import read_gguf_adapter

        found, scaling_of = read_gguf_adapter(name, Path(path), config)
    else:
        found, scaling_of = _read_peft_adapter(name, Path(path))
    return assemble(name, str(path), found, scaling_of, config, max_rank)


def _read_peft_adapter(name: str, directory: Path):
    """(PEFT module's (layer, name) -> {"A": tensor, "B": tensor}, rank -> scaling) of a PEFT directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    settings = _read_settings(name, directory)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise AdapterError(
            f"LoRA adapter {name!r}: {weights_file} is missing"
            + ("; adapter_model.bin is a pickle, not loaded: save with safe_serialization=True" if pickled else "")
        )
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {weights_file} ({error})") from None
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        matched = _TENSOR.match(tensor_name)
        if matched is None or matched.group(2) not in TARGETS:
            raise AdapterError(
                f"LoRA adapter {name!r}: tensor {tensor_name!r} adapts a module this server cannot: LoRA targets "
                f"must be among {sorted(TARGETS)} (attention and MLP projections)"
            )
        found.setdefault((int(matched.group(1)), matched.group(2)), {})[matched.group(3)] = tensor
    if not found:
        raise AdapterError(f"LoRA adapter {name!r}: {weights_file} holds no lora_A / lora_B tensors")
    alpha, rslora = settings["lora_alpha"], bool(settings.get("use_rslora", False))
    return found, (lambda rank: alpha / math.sqrt(rank)) if rslora else (lambda rank: alpha / rank)


def assemble(
    name: str, path: str, found: dict[tuple[int, str], dict[str, torch.Tensor]], scaling_of, config, max_rank: int
) -> LoRAAdapter:
    """The adapter of `found` ((layer, PEFT module name) -> its A and B, in PEFT's layouts [r, in] and [out, r])
    checked against the base `config`, each module scaled by scaling_of(its rank)."""
    ranges = output_ranges(config)
    parts: list[dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]] = [{} for _ in range(config.num_hidden_layers)]
    digest = hashlib.sha256(b"prefixserve lora\0")
    rank = 0
    scalings = set()
    for (layer, module), pair in sorted(found.items()):
        if layer >= config.num_hidden_layers:
            raise AdapterError(
                f"LoRA adapter {name!r}: it adapts layer {layer}, but the base has {config.num_hidden_layers} "
                "layers: an adapter for another base model?"
            )
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} alone")
        a, b = pair["A"].float(), pair["B"].float()
        fused, start, size, in_features = ranges[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_features) or tuple(b.shape) != (size, r):
            raise AdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this base needs A (r, {in_features}) and B ({size}, r): an adapter for another base model?"
            )
        if r > max_rank:
            raise AdapterError(
                f"LoRA adapter {name!r}: rank {r} (layer {layer} {module}) exceeds max_lora_rank={max_rank}; "
                "raise --max-lora-rank"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module} holds NaN or infinity")
        scaling = scaling_of(r)
        parts[layer].setdefault(fused, []).append((a, b, start))
        scalings.add(scaling)
        rank = max(rank, r)
        digest.update(f"{layer}.{module}:{scaling!r}:{tuple(a.shape)}:{tuple(b.shape)}".encode())
        digest.update(a.contiguous().numpy().tobytes())
        digest.update(b.contiguous().numpy().tobytes())
    if len(scalings) > 1:  # one rank and alpha for every module (rank_pattern and alpha_pattern are refused)
        raise AdapterError(f"LoRA adapter {name!r}: its modules have different ranks; give every module one rank")
    (scaling,) = scalings
    widths = {"qkv": ranges["qkv_proj"][2], "o": ranges["o_proj"][2], "gate_up": ranges["gate_up_proj"][2]}
    widths["down"] = ranges["down_proj"][2]
    layers = [
        {module: fuse(pieces, widths[module], scaling) for module, pieces in layer_parts.items()}
        for layer_parts in parts
    ]
    return LoRAAdapter(name, path, rank, digest.hexdigest(), layers)


def fuse(pieces: list[tuple[torch.Tensor, torch.Tensor, int]], width: int, scaling: float) -> FusedUpdate:
    """One FusedUpdate of a projection's adapted parts (A, B, first output column), `width` output columns."""
    a = torch.cat([piece[0] for piece in pieces])
    b = torch.zeros(width, a.shape[0])
    offset, parts = 0, []
    for piece_a, piece_b, start in pieces:
        rank = piece_a.shape[0]
        b[start : start + piece_b.shape[0], offset : offset + rank] = piece_b
        parts.append((offset, rank, start, piece_b.shape[0]))
        offset += rank
    return FusedUpdate(a.contiguous(), b.contiguous(), scaling, tuple(parts))


def _read_settings(name: str, directory: Path) -> dict:
    config_file = directory / "adapter_config.json"
    if not directory.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {directory} is not a directory (a PEFT adapter's save_pretrained)")
    try:
        settings = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is missing") from None
    except (OSError, ValueError) as error:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {config_file} ({error})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {config_file} is not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type is {settings.get('peft_type')!r}, not 'LORA'")
    for option, what in _REFUSED_OPTIONS.items():
        if settings.get(option):
            raise AdapterError(f"LoRA adapter {name!r}: {what} is not served; got {option}={settings[option]!r}")
    if settings.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {name!r}: trained biases (bias={settings['bias']!r}) are not served")
    alpha = settings.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return settings
