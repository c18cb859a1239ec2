"""One version of a model, as served: weights, tokenizer, end-of-sequence ids, the cache scope they
make, the prompt scoper and the longest sequence it serves. Immutable.

The engine holds its version through one reference (CurrentVersion), which the runner, the input
and output processors and the server read; a hot reload swaps that reference once (reload.py), so
no reader can see half of one version and half of another. Loading runs anywhere (a worker thread
during a reload, so the server keeps answering); nothing here touches engine state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from ..cache import CacheScope
from ..cache.scoping import PromptScoper
from ..model import DEFAULT_MODEL_NAME, Tokenizer, ensure_default_model, load_generation_eos, load_model
from ..model.weights.hf_loader import LoadedModel

logger = logging.getLogger("prefixserve")


@dataclass(frozen=True)
class ModelVersion:
    path: Path  # the checkpoint directory (a .gguf is converted to one)
    name: str  # what the user named: a directory, a .gguf file, a model name, or the built-in default
    loaded: LoadedModel
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    # Chains every prompt's block keys from this version's scope (model and tokenizer fingerprints and
    # the numerics: a new version of any makes every old block unreachable), per tenant salt.
    scoper: PromptScoper
    max_model_len: int  # the longest prompt + output served: the model's context, or less (within())
    source: Path  # what a reload reads again: the GGUF file, or the checkpoint directory
    weights: str  # how the weights are held: "float", "gguf" (quantized as the file has them), "int8", "int4"

    @property
    def scope(self) -> CacheScope:
        return self.scoper.scope

    @property
    def config(self):
        return self.loaded.config

    @property
    def model(self):
        return self.loaded.model

    def within(self, max_model_len: int) -> "ModelVersion":
        """This version serving at most `max_model_len` tokens (what the KV pool holds, or the operator set)."""
        if not 0 < max_model_len <= self.config.max_context_len:
            raise ValueError(
                f"max_model_len must be in [1, {self.config.max_context_len}] for {self.name}, got {max_model_len}"
            )
        return replace(self, max_model_len=max_model_len)

    def succeeding(self, previous: "ModelVersion") -> "ModelVersion":
        """This version as the successor of `previous` in a hot reload: no longer a context than the
        previous one served (the pool was sized for it), and the declared public prefixes carried over
        when both have the same tokenizer (they are token ids: another tokenizer reads them otherwise)."""
        successor = self.within(min(previous.max_model_len, self.config.max_context_len))
        if previous.tokenizer.fingerprint == self.tokenizer.fingerprint:
            for prefix in previous.scoper.shared_prefixes:
                successor.scoper.declare_shared_prefix(prefix)
        elif previous.scoper.shared_prefixes:
            logger.warning(
                "reload: the tokenizer changed, so %d declared shared prefixes (token ids) were dropped; "
                "declare them again",
                len(previous.scoper.shared_prefixes),
            )
        return successor


class CurrentVersion:
    """The one reference to the version an engine serves; swap() is the only way it changes."""

    def __init__(self, version: ModelVersion) -> None:
        self._version = version

    @property
    def version(self) -> ModelVersion:
        return self._version

    def swap(self, version: ModelVersion) -> ModelVersion:
        """Serve `version` from now on; returns the one it replaces."""
        previous, self._version = self._version, version
        return previous


def resolve_model_path(model: Optional[str]) -> Path:
    """The checkpoint directory of `model`: built-in (None), a Hugging Face directory, a .gguf file
    or a directory holding one (converted once), or a model name such as smollm2-135m-instruct."""
    if model is None:
        return ensure_default_model()
    from ..model.weights.named_models import resolve_model  # imports the gguf reader only when asked

    path = resolve_model(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist; pass a Hugging Face checkpoint "
            "directory (config.json, *.safetensors, tokenizer.json), a .gguf file, "
            "a model name, or model=None for the built-in default"
        )
    return path


def weight_format(
    model: Optional[str],
    quantize: Optional[str] = None,
    dequantize: bool = False,
    device: Optional[torch.device] = None,
) -> str:
    """How `model`'s weights are held: quantized to `quantize`, as a GGUF file holds them ("gguf", unless
    `dequantize`, off the CPU (the quantized kernels are CPU kernels) or a file of float weights only), or as
    floats."""
    if quantize is not None:
        return quantize
    if device is not None and device.type != "cpu":
        return "float"
    from ..model.weights.named_models import gguf_file_of
    from ..model.weights.quantized_model import holds_quantized_weights

    source = None if dequantize else gguf_file_of(model)
    return "gguf" if source is not None and holds_quantized_weights(source) else "float"


def load_version(
    model: Optional[str],
    dtype: torch.dtype,
    device: torch.device,
    numerics: str,
    block_size: int,
    batch_size_hint: Optional[int] = None,
    weights: str = "float",
) -> ModelVersion:
    """Load weights and tokenizer, serving the model's whole context; with `batch_size_hint`, also lay
    the linear weights out for oneDNN (CPU) sized for a step of that many tokens. `numerics`:
    numerics_fingerprint()'s; `weights`: weight_format()'s."""
    path = resolve_model_path(model)
    loaded = load_model(path, dtype, device)
    gguf = None
    if model is not None:
        from ..model.weights.named_models import gguf_file_of

        gguf = gguf_file_of(model)
    if weights != "float":
        from ..model.weights.quantized_model import serve_quantized

        loaded = serve_quantized(loaded, weights, gguf, device)
    tokenizer = Tokenizer.from_dir(path)
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(load_generation_eos(path))
    if batch_size_hint is not None:
        loaded.model.pack_linear_weights(batch_size_hint=batch_size_hint)
    scope = CacheScope(loaded.model_fingerprint, tokenizer.fingerprint, numerics=numerics)
    return ModelVersion(
        path=path,
        name=str(model) if model else DEFAULT_MODEL_NAME,
        loaded=loaded,
        tokenizer=tokenizer,
        eos_token_ids=eos,
        scoper=PromptScoper(scope, block_size),
        max_model_len=loaded.config.max_context_len,
        source=gguf or path,
        weights=weights,
    )
