"""LoRA adapters served from one base model: PEFT's files, vLLM's LoRARequest, a bounded adapter cache, and the
per-row updates a step applies (each request's rows get its own adapter's, the base's rows none)."""

from .adapter import AdapterError, LoRAAdapter
from .lora_request import LoRARequest

__all__ = ["AdapterError", "LoRAAdapter", "LoRARequest"]
