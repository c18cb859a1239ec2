"""The built-in default model ``prefixserve-tiny``: a small Llama with fixed-seed random weights.

Generated on first use into the user cache directory in Hugging Face layout, so transformers
loads the same directory (the reference tests rely on that)::

    $PREFIXSERVE_CACHE_DIR | $XDG_CACHE_HOME/prefixserve | ~/.cache/prefixserve
        prefixserve-tiny-v1/  config.json  model.safetensors  tokenizer.json
                              tokenizer_config.json  generation_config.json

Its text is gibberish, but its cost profile is a real model's, and its logits are well separated
(see _init_scales), so greedy decoding is reproducible across implementations.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


DEFAULT_MODEL_NAME = "prefixserve-tiny"
DEFAULT_MODEL_VERSION = "v1"  # bump when the weights, config or tokenizer change
SEED = 20240601
logger = logging.getLogger("prefixserve.model")
_DATA_DIR = Path(__file__).parent / "data"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

BOS_TOKEN_ID = 0  # <|begin_of_text|>
EOS_TOKEN_ID = 1  # <|end_of_text|>
IM_END_TOKEN_ID = 3  # <|im_end|>, ends an assistant turn

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1344,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float32",
}

GENERATION_CONFIG = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, IM_END_TOKEN_ID],
}


def default_cache_root() -> Path:
    if os.environ.get("PREFIXSERVE_CACHE_DIR"):
        return Path(os.environ["PREFIXSERVE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "prefixserve"
    return Path.home() / ".cache" / "prefixserve"


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the default model directory, generating it on first use (about a second)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("generating the built-in model %s into %s (first use only) ...", DEFAULT_MODEL_NAME, target)
    began = time.perf_counter()
    # Build in a temporary sibling and rename: the rename is atomic, so a reader never sees a
    # half-written model, and when two processes race, the loser drops its copy and uses the
    # winner's (identical bytes either way).
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_default_model(staging)
        try:
            os.rename(staging, target)
        except OSError as error:
            if not (target / "config.json").is_file():  # not a lost race: a broken directory
                raise RuntimeError(f"{target} exists but holds no config.json; delete it and retry") from error
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("generated %s in %.1f s", target, time.perf_counter() - began)
    return target


def default_tokenizer_dir(cache_dir: str | Path | None = None) -> Path:
    """A directory with the built-in model's tokenizer (the same fingerprint), written without torch: the
    model's own directory once generated, else a tokenizer-only sibling. What a router without --model reads."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    model = root / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    if (model / "config.json").is_file():
        return model
    target = root / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}-tokenizer"
    if not (target / "generation_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        _write_tokenizer_files(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process won the race: its files are the same bytes
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_tokenizer_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(_DATA_DIR / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")


def write_default_model(directory: Path) -> None:
    from safetensors.torch import save_file

    _write_tokenizer_files(directory)
    save_file(default_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    # config.json last: its presence marks a complete directory.
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")


def _init_scales() -> dict[str, float]:
    """Standard deviation of each weight kind.

    Random weights usually give near-flat logits, and then float noise decides greedy argmax
    differently in two implementations. These scales give logits with a std of ~4.5 (top-1 vs
    top-2 gaps of a unit or so) while each block's output stays comparable to the residual
    stream, so attention (context) and not only the last token decides the next token.
    """
    hidden = CONFIG["hidden_size"]
    return {
        "embed": 1.0,  # residual stream starts at RMS 1
        "lm_head": 0.2,  # after RMSNorm: logit std 0.2 * sqrt(512) ~ 4.5
        "qk": 2.0 / math.sqrt(hidden),  # sharper-than-uniform attention
        "v": 1.0 / math.sqrt(hidden),
        "o": 1.0 / math.sqrt(hidden),
        "gate_up": 1.0 / math.sqrt(hidden),
        "down": 1.0 / math.sqrt(CONFIG["intermediate_size"]),
    }


def default_weights() -> dict[str, "torch.Tensor"]:
    """Fixed-seed weights, in Hugging Face names, drawn in a fixed order.

    Uniform (not normal) draws: torch's CPU uniform sampler is integer arithmetic, while its
    vectorised normal sampler uses SLEEF log/cos approximations that can differ in the last bit
    between CPU instruction sets. Uniform bytes are identical on every machine.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(SEED)
    scales = _init_scales()
    hidden, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    head_dim = CONFIG["head_dim"]
    q_size = CONFIG["num_attention_heads"] * head_dim
    kv_size = CONFIG["num_key_value_heads"] * head_dim

    def uniform(shape: tuple[int, ...], std: float) -> torch.Tensor:
        # U(-a, a) has std a / sqrt(3).
        bound = std * math.sqrt(3.0)
        return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound

    tensors = {"model.embed_tokens.weight": uniform((CONFIG["vocab_size"], hidden), scales["embed"])}
    for index in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        tensors[prefix + "self_attn.q_proj.weight"] = uniform((q_size, hidden), scales["qk"])
        tensors[prefix + "self_attn.k_proj.weight"] = uniform((kv_size, hidden), scales["qk"])
        tensors[prefix + "self_attn.v_proj.weight"] = uniform((kv_size, hidden), scales["v"])
        tensors[prefix + "self_attn.o_proj.weight"] = uniform((hidden, q_size), scales["o"])
        tensors[prefix + "mlp.gate_proj.weight"] = uniform((inter, hidden), scales["gate_up"])
        tensors[prefix + "mlp.up_proj.weight"] = uniform((inter, hidden), scales["gate_up"])
        tensors[prefix + "mlp.down_proj.weight"] = uniform((hidden, inter), scales["down"])
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = uniform((CONFIG["vocab_size"], hidden), scales["lm_head"])
    return tensors
