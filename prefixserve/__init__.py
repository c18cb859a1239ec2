"""prefixserve: an LLM serving engine built around a token-exact, model-scoped prefix KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputs"]
__version__ = "0.1.0"

# Imported on first use, so `prefixserve.cache` and `prefixserve.router` (plain Python) load
# without paying for torch.
_LAZY = {
    "LLM": "prefixserve.llm",
    "EngineConfig": "prefixserve.config",
    "LoRARequest": "prefixserve.lora.lora_request",
    "RequestOutput": "prefixserve.engine.outputs",
    "SamplingParams": "prefixserve.engine.sampling_params",
    "StructuredOutputs": "prefixserve.engine.structured_output",
}

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine.outputs import RequestOutput
    from .engine.sampling_params import SamplingParams
    from .engine.structured_output import StructuredOutputs
    from .llm import LLM
    from .lora.lora_request import LoRARequest


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
