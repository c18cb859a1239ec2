"""What the engine comparisons do first: run as a lesser CPU when asked, resolve the one checkpoint every engine
loads, and where their results go (compare.py and serve_bench.py share it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parent / "results"


def cap_and_reexecute(variant: str) -> None:
    """Run this script again with the caps of `variant` in the environment (ATen and oneDNN read them
    once, at start), unless they are set already."""
    from prefixserve.model.kernel_variants import capped_environment, variants_for

    names = [candidate.name for candidate in variants_for()]
    if variant not in names:
        raise SystemExit(f"--cpu-isa {variant!r}: this machine's variants are {', '.join(names)}")
    wanted = capped_environment(variant)
    if all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    env = {**os.environ, **wanted}
    print("running as a " + variant + " CPU: " + " ".join(f"{k}={v}" for k, v in wanted.items()), flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def resolve_model_dir(model: Optional[str]) -> Path:
    """The checkpoint directory every engine loads: the built-in model, or --model resolved (a GGUF is
    converted once), so prefixserve, transformers and vLLM read the very same weights."""
    if model is None:
        from prefixserve.model import ensure_default_model

        return ensure_default_model()
    from prefixserve.model.weights.named_models import resolve_model

    return resolve_model(model)
