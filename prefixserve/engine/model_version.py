"""One loaded version of a model: weights, tokenizer, end-of-sequence ids and the cache scope they make.

The engine starts with one and a hot reload swaps in another (reload.py). Loading runs
anywhere (a worker thread during a reload, so the server keeps answering); nothing here
touches engine state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..cache import CacheScope
from ..model import DEFAULT_MODEL_NAME, Tokenizer, ensure_default_model, load_generation_eos, load_model
from ..model.loader import LoadedModel

logger = logging.getLogger("prefixserve")


@dataclass
class ModelVersion:
    path: Path  # the checkpoint directory (a .gguf is converted to one)
    name: str  # what the user named: a directory, a .gguf file, a model name, or the built-in default
    loaded: LoadedModel
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    numerics: str  # how K/V is computed here (numerics.py): replicas that differ share no blocks

    @property
    def scope(self) -> CacheScope:
        """Model and tokenizer fingerprints and the numerics: a new version of any makes every old block
        unreachable."""
        return CacheScope(self.loaded.model_fingerprint, self.tokenizer.fingerprint, numerics=self.numerics)


def resolve_model_path(model: Optional[str]) -> Path:
    """The checkpoint directory of `model`: built-in (None), a Hugging Face directory, a .gguf file
    or a directory holding one (converted once), or a model name such as smollm2-135m-instruct."""
    if model is None:
        return ensure_default_model()
    from ..model.named_models import resolve_model  # imports the gguf reader only when asked

    path = resolve_model(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist; pass a Hugging Face checkpoint "
                                "directory (config.json, *.safetensors, tokenizer.json), a .gguf file, "
                                "a model name, or model=None for the built-in default")
    return path


def load_version(model: Optional[str], dtype: torch.dtype, device: torch.device, numerics: str,
                 batch_size_hint: Optional[int] = None) -> ModelVersion:
    """Load weights and tokenizer; with `batch_size_hint`, also lay the linear weights out for
    oneDNN (CPU) sized for a step of that many tokens. `numerics`: numerics_fingerprint()'s."""
    path = resolve_model_path(model)
    loaded = load_model(path, dtype, device)
    tokenizer = Tokenizer.from_dir(path)
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(load_generation_eos(path))
    if batch_size_hint is not None:
        loaded.model.pack_linear_weights(batch_size_hint=batch_size_hint)
    return ModelVersion(path=path, name=str(model) if model else DEFAULT_MODEL_NAME, loaded=loaded,
                        tokenizer=tokenizer, eos_token_ids=eos, numerics=numerics)
