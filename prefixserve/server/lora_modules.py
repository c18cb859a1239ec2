"""The LoRA adapters a server serves, by the model name a request gives: `--lora-modules name=path` at start-up,
and (with --allow-runtime-lora-updating, the role of vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) the admin's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter. A name is an adapter's; its weights decide its cache
scope (lora/adapter.py), so a name loaded again with new weights reads none of its old blocks."""

from __future__ import annotations

import argparse
import json
import logging
import threading
from typing import Iterable, Optional

from ..lora.lora_request import LoRARequest


def parse_lora_module(text: str) -> tuple[str, str]:
    """vLLM's `--lora-modules` item: name=path, or JSON {"name": ..., "path": ...}; ValueError naming the form."""
    text = text.strip()
    if text.startswith("{"):
        try:
            given = json.loads(text)
        except ValueError as error:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({error})") from None
        if (
            not isinstance(given, dict)
            or not isinstance(given.get("name"), str)
            or not isinstance(given.get("path"), str)
        ):
            raise ValueError(f'--lora-modules {text!r}: give {{"name": "...", "path": "..."}} or name=path')
        return given["name"], given["path"]
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give name=path (a PEFT adapter's directory)")
    return name, path


def lora_module_flag(text: str) -> tuple[str, str]:
    """`--lora-modules`' argparse type: parse_lora_module's error as argparse shows a bad value."""
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_lora_flags(modules: "LoRAModules", enable_lora: bool) -> None:
    if (modules or modules.runtime_updates) and not enable_lora:
        raise SystemExit("prefixserve serve: --lora-modules and --allow-runtime-lora-updating need --enable-lora")


def load_lora_modules(modules: "LoRAModules", engine) -> None:
    """Read and check every --lora-modules adapter before serving (a bad one stops the start, naming the cause),
    and say in the start-up log what is loaded."""
    for lora in modules.requests():
        try:
            engine.inputs.adapter_of(lora)
        except ValueError as error:
            raise SystemExit(f"prefixserve serve: --lora-modules: {error}") from None
    if modules:
        loaded = engine.inputs.adapters.loaded()
        logging.getLogger("prefixserve").info(
            "LoRA adapters: %s", ", ".join(f"{a['name']} (rank {a['rank']}, {a['fingerprint']})" for a in loaded)
        )


class LoRAModules:
    def __init__(self, modules: Iterable[tuple[str, str]] = (), runtime_updates: bool = False) -> None:
        self.runtime_updates = runtime_updates
        self._lock = threading.Lock()  # requests read it on the event loop and in worker threads
        self._requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in modules:
            if name in self._requests:
                raise ValueError(f"--lora-modules names {name!r} twice; give each adapter one name")
            self.add(name, path)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def request_for(self, name: Optional[str]) -> Optional[LoRARequest]:
        with self._lock:
            return self._requests.get(name) if name is not None else None

    def add(self, name: str, path: str) -> LoRARequest:
        with self._lock:
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            self._requests[name] = request
            return request

    def remove(self, name: str) -> Optional[LoRARequest]:
        with self._lock:
            return self._requests.pop(name, None)

    def requests(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._requests.values())
