"""The adapters an engine holds: loaded on first use from their path, at most `max_cpu_loras` at once (the least
recently used leaves first), in float32 as peft keeps them by default. Requests are made on the server's
worker threads as well as the engine's, so it is locked."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from .adapter import AdapterError, LoRAAdapter, load_adapter
from .lora_request import LoRARequest


class AdapterRegistry:
    def __init__(self, current, max_rank: int, max_cpu_loras: int) -> None:
        self.current = current  # the served version (its config: what an adapter's shapes are checked against)
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, tuple[tuple, LoRAAdapter]] = OrderedDict()  # name -> (file stamp, adapter)

    def resolve(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter `lora_request` names, loaded again when its files changed; AdapterError names the cause."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        with self._lock:
            return self._resolve(lora_request.lora_name, lora_request.lora_path)

    def _resolve(self, name: str, path: str) -> LoRAAdapter:
        version = self.current.version
        stamp = (version.scope.model_fingerprint, *self._stamp(name, path))  # a reload checks every adapter again
        held = self._loaded.get(name)
        if held is not None and held[0] == stamp:
            self._loaded.move_to_end(name)
            return held[1]
        adapter = load_adapter(name, path, version.config, self.max_rank)
        self._loaded[name] = (stamp, adapter)
        self._loaded.move_to_end(name)
        self._shrink()
        return adapter

    def loaded(self) -> list[dict]:
        """What is loaded, most recently used last."""
        with self._lock:
            return [
                {"name": name, "path": adapter.path, "rank": adapter.rank, "fingerprint": adapter.fingerprint[:16]}
                for name, (_, adapter) in self._loaded.items()
            ]

    def _shrink(self) -> None:
        """Drop the least recently used adapters while more than max_cpu_loras are loaded (a request that holds
        one keeps its weights until it finishes; asked for again, it is read from its files again)."""
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)

    @staticmethod
    def _stamp(name: str, path: str) -> tuple:
        """What says an adapter's files changed under its name: their sizes and modification times."""
        if os.path.isfile(path):  # a GGUF LoRA file
            stat = os.stat(path)
            return (path, (stat.st_size, stat.st_mtime_ns))
        stamps = []
        for file_name in ("adapter_config.json", "adapter_model.safetensors"):
            try:
                stat = os.stat(os.path.join(path, file_name))
            except OSError:
                stamps.append(None)
                continue
            stamps.append((stat.st_size, stat.st_mtime_ns))
        if stamps == [None, None] and not os.path.isdir(path):
            raise AdapterError(
                f"LoRA adapter {name!r}: {path!r} is neither a directory (a PEFT adapter's save_pretrained) nor a "
                "GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py)"
            )
        return (path, *stamps)
