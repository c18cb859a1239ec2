"""GGUF checkpoints, converted once into a cached Hugging Face directory the loader already reads.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
      -> <user cache dir>/gguf/<first 16 hex of the file's SHA-256>/
             config.json  model.safetensors (float32)  tokenizer.json  tokenizer_config.json
             generation_config.json  prefixserve_source.json (the GGUF's SHA-256, the converter version)

The directory is keyed by the file's content, so a changed file converts again and an unchanged
one (found again by path, size and mtime, without rereading it) starts in well under a second.
The conversion is deterministic, so ``gguf_fingerprint`` (the file hash and the converter
version) identifies the converted weights as well as hashing them would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from ..default import default_cache_root
from ..tokenizers.gguf_tokenizer import build_tokenizer_files, write_tokenizer_files
from .gguf_checkpoint import TensorPlan, hf_config, load_tensor, plan_tensors, read_metadata
from .gguf_source import SOURCE_FILE, gguf_fingerprint, read_gguf_source, read_json_object

__all__ = ["CONVERTER_VERSION", "SOURCE_FILE", "convert_gguf", "find_gguf_file", "gguf_fingerprint", "read_gguf_source"]

logger = logging.getLogger("prefixserve.model")

CONVERTER_VERSION = 1  # bump when the converted bytes would change; old directories are redone
_HASH_MEMO = "hashes.json"
_CHUNK_SIZE = 8 * 1024**2


def convert_gguf(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The Hugging Face directory converted from the GGUF at ``path`` (a .gguf file, or a
    directory holding exactly one), converting it on first use. ``cache_dir`` is the user cache
    root (default: PREFIXSERVE_CACHE_DIR, XDG_CACHE_HOME/prefixserve or ~/.cache/prefixserve)."""
    source = find_gguf_file(path)
    root = (Path(cache_dir) if cache_dir is not None else default_cache_root()) / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    digest = file_sha256(source, root / _HASH_MEMO)
    target = root / digest[:16]
    if _is_converted(target, digest):
        return target
    logger.info("converting %s into %s (first use only) ...", source, target)
    began = time.perf_counter()
    # Build in a temporary sibling and rename it into place (atomic): a reader never sees a
    # half-written directory, and of two racing processes the loser drops its identical copy.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_hf_checkpoint(source, staging, digest)
        if target.exists() and not _is_converted(target, digest):  # older converter, or broken
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=root))
            os.rename(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_converted(target, digest):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s", source.name, time.perf_counter() - began)
    return target


def find_gguf_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            names = ", ".join(file.name for file in found) or "none"
            raise ValueError(
                f"{path} holds {len(found)} .gguf files ({names}); name the file to load instead of the directory"
            )
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return path


def write_hf_checkpoint(source: Path, directory: Path, digest: str) -> None:
    """Convert ``source`` into ``directory`` (which exists). config.json comes last: its
    presence marks a complete checkpoint."""
    reader = open_gguf(source)
    try:
        metadata = read_metadata(reader)
        config = hf_config(metadata, reader, source)
        plans = plan_tensors(reader, config, source)
        tokenizer_files = build_tokenizer_files(metadata, source)
        write_tokenizer_files(tokenizer_files, directory)
        config.setdefault("eos_token_id", tokenizer_files.generation_config["eos_token_id"])
        write_safetensors(directory / "model.safetensors", plans)
    except (KeyError, IndexError, TypeError, OverflowError) as error:
        raise ValueError(
            f"{source} is not a valid GGUF file ({type(error).__name__}: {error}); download it again"
        ) from error
    types = sorted({plan.source.tensor_type.name for plan in plans})
    record = {
        "format": "gguf",
        "file": source.name,
        "size": source.stat().st_size,
        "sha256": digest,
        "converter_version": CONVERTER_VERSION,
        "tensor_types": types,
        "architecture": metadata.get("general.architecture"),
        "name": metadata.get("general.name"),
    }
    (directory / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def open_gguf(source: Path) -> GGUFReader:
    """The reference reader over ``source``; a truncated or foreign file is a ValueError naming it."""
    try:
        return GGUFReader(source)
    except Exception as error:  # the reader fails with numpy/struct errors of many kinds
        raise ValueError(
            f"{source} is not a readable GGUF file ({type(error).__name__}: {error}); "
            f"it may be truncated or not a GGUF at all: download it again"
        ) from error


def write_safetensors(path: Path, plans: list[TensorPlan]) -> None:
    """A float32 safetensors file written one tensor at a time, so converting never holds more
    than one dequantized tensor in memory. The layout is the format's: an 8-byte little-endian
    header length, a JSON header padded with spaces to 8 bytes, then the tensors back to back."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in plans:
        size = 4 * int(np.prod(plan.hf_shape))
        header[plan.hf_name] = {"dtype": "F32", "shape": list(plan.hf_shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for plan in plans:
            handle.write(load_tensor(plan).astype("<f4", copy=False).data)  # C-contiguous: no copy
        assert handle.tell() == 8 + len(encoded) + offset, f"{path}: tensor sizes disagree with the header"


def file_sha256(path: Path, memo_file: Path | None = None) -> str:
    """SHA-256 of the file's bytes, read in chunks. With ``memo_file``, a hash computed before
    for the same path, size and mtime is reused, so a second start does not reread the file."""
    stat = path.stat()
    key = str(path.resolve())
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = read_json_object(memo_file) if memo_file is not None else {}
    entry = memo.get(key)
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and entry.get("sha256"):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_SIZE):
            digest.update(chunk)
    if memo_file is not None:
        memo[key] = {**stamp, "sha256": digest.hexdigest()}
        _write_json_atomically(memo_file, memo)
    return digest.hexdigest()


def _is_converted(directory: Path, digest: str) -> bool:
    if not (directory / "config.json").is_file():
        return False
    record = read_gguf_source(directory) or {}
    return record.get("sha256") == digest and record.get("converter_version") == CONVERTER_VERSION


def _write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    # A lost update between two processes only costs a rehash later; a torn file is never read.
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(handle, "w") as file:
        json.dump(value, file, indent=1)
    os.replace(temporary, path)
