"""Model side of prefixserve: the Llama family over a paged KV cache, loading, tokenization.

The torch parts load on first use of a name that needs them (PEP 562 `__getattr__`), so the
tokenizer (`prefixserve.model.tokenizers.tokenizer`, `model_config`, `default.default_tokenizer_dir`) imports
without torch: a router box needs no PyTorch. Never imports prefixserve.engine or prefixserve.cache.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {  # name -> submodule that defines it
    "AttentionMetadata": "attention.metadata",
    "paged_attention": "attention.paged",
    "write_kv": "attention.paged",
    "DEFAULT_MODEL_NAME": "default",
    "ensure_default_model": "default",
    "LlamaForCausalLM": "families.llama",
    "LoadedModel": "weights.hf_loader",
    "load_generation_eos": "weights.hf_loader",
    "load_model": "weights.hf_loader",
    "SUPPORTED_ARCHITECTURES": "families.model_config",
    "ModelConfig": "families.model_config",
    "IncrementalDecoder": "tokenizers.tokenizer",
    "Tokenizer": "tokenizers.tokenizer",
}

__all__ = [  # = sorted(_EXPORTS); a literal so linters see the re-exports below
    "AttentionMetadata",
    "DEFAULT_MODEL_NAME",
    "IncrementalDecoder",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "Tokenizer",
    "ensure_default_model",
    "load_generation_eos",
    "load_model",
    "paged_attention",
    "write_kv",
]

if TYPE_CHECKING:
    from .attention.metadata import AttentionMetadata
    from .attention.paged import paged_attention, write_kv
    from .default import DEFAULT_MODEL_NAME, ensure_default_model
    from .families.llama import LlamaForCausalLM
    from .families.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
    from .tokenizers.tokenizer import IncrementalDecoder, Tokenizer
    from .weights.hf_loader import LoadedModel, load_generation_eos, load_model


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
