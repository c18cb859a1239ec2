"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into LlamaForCausalLM.

The model fingerprint is part of every prefix-cache key (docs/design.md, rule 2), so it covers
everything that changes the KV a model computes: the config and the weight bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..families.gemma import GemmaForCausalLM
from ..families.llama import LlamaForCausalLM
from ..families.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, load_generation_eos
from .gguf_source import gguf_fingerprint

__all__ = ["LoadedModel", "load_model", "load_generation_eos", "model_fingerprint", "find_weight_files"]

logger = logging.getLogger("prefixserve.model")

MODEL_CLASSES = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}  # the other families are LlamaForCausalLM's switches
EXPECTED_LAYOUT = "expected a Hugging Face checkpoint directory with config.json and *.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Files above this size are fingerprinted by sampling (see _hash_weight_file).
FULL_HASH_LIMIT = 2 * 1024**3
NUM_SAMPLES = 64
SAMPLE_SIZE = 1024**2
_CHUNK_SIZE = 8 * 1024**2


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    model_fingerprint: str  # hex SHA-256
    path: Path


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    path = Path(path)
    config_dict = read_config_dict(path)
    architecture = (config_dict.get("architectures") or ["<none>"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path / 'config.json'}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = ModelConfig.from_hf_dict(config_dict)
    weight_files = find_weight_files(path)
    weight_bytes = sum(file.stat().st_size for file in weight_files)
    logger.info(
        "loading %s (%d weight file%s, %.0f MiB) as %s on %s ...",
        path,
        len(weight_files),
        "" if len(weight_files) == 1 else "s",
        weight_bytes / 2**20,
        str(dtype).removeprefix("torch."),
        device,
    )
    began = time.perf_counter()

    # Build on the meta device and allocate directly in the target dtype/device, so a large
    # model never exists as a float32 copy with throw-away random init.
    with torch.device("meta"):
        model = MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_rotary()
    model.load_weights(_iter_tensors(weight_files))
    model.eval().requires_grad_(False)
    loaded = time.perf_counter()
    fingerprint = _converted_fingerprint(path) or model_fingerprint(config_dict, weight_files)
    logger.info(
        "loaded %s in %.1f s; weights fingerprinted in %.1f s (%s)",
        path.name,
        loaded - began,
        time.perf_counter() - loaded,
        fingerprint[:12],
    )
    return LoadedModel(model=model, config=config, model_fingerprint=fingerprint, path=path)


def read_config_dict(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist ({EXPECTED_LAYOUT})")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found ({EXPECTED_LAYOUT})")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from error


def find_weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the shard index, else all *.safetensors."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file} is listed in {index_path} but does not exist")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} ({EXPECTED_LAYOUT})")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    # One tensor at a time; load_weights copies (and casts) it into place.
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _converted_fingerprint(path: Path) -> str | None:
    """A directory converted from a GGUF file is fingerprinted by that file's hash (no rehash of its weights)."""
    return gguf_fingerprint(path)


def model_fingerprint(config_dict: dict, weight_files: list[Path]) -> str:
    """SHA-256 over the canonical config JSON and every weight file (name, size, content).

    Files over 2 GiB are hashed as their safetensors header (tensor names, dtypes, shapes,
    offsets), their size, and 64 evenly spaced 1 MiB samples, so fingerprinting a 140 GB
    checkpoint reads 64 MiB per file instead of every byte. A change confined to unsampled
    bytes of such a file goes unnoticed; a retrained or re-quantized model changes the samples.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config_dict, sort_keys=True, separators=(",", ":")).encode())
    for file in weight_files:
        digest.update(f"\0{file.name}\0{file.stat().st_size}\0".encode())
        _hash_weight_file(file, digest)
    return digest.hexdigest()


def _hash_weight_file(file: Path, digest) -> None:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        if size <= FULL_HASH_LIMIT:
            while chunk := handle.read(_CHUNK_SIZE):
                digest.update(chunk)
            return
        header_len = int.from_bytes(handle.read(8), "little")
        handle.seek(0)
        digest.update(handle.read(8 + header_len))
        step = (size - SAMPLE_SIZE) // (NUM_SAMPLES - 1)
        for index in range(NUM_SAMPLES):
            handle.seek(index * step)
            digest.update(handle.read(SAMPLE_SIZE))
