"""prefixserve: an LLM serving engine built around a token-exact, model-scoped prefix KV cache."""

from .config import EngineConfig
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .llm import LLM

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
