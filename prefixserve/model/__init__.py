"""Model side of prefixserve: the Llama family over a paged KV cache, loading, tokenization.

Imports torch; never imports prefixserve.engine or prefixserve.cache.
"""

from .attention import AttentionMetadata, paged_attention, write_kv
from .default import DEFAULT_MODEL_NAME, ensure_default_model
from .llama import LlamaForCausalLM
from .loader import LoadedModel, load_generation_eos, load_model
from .model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from .tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
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
