"""Another version of a checkpoint: the same config, tokenizer and KV layout, weights moved by seeded noise.

What a rolling deploy swaps in, for drills and tests that need two models a router must never mix
(benchmarks/chaos.py, the reload and rolling-deploy tests): every answer differs, every key layout agrees.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def write_model_version(source: Path, directory: Path, seed: int, scale: float = 0.3) -> Path:
    """The checkpoint at `source` copied to `directory` with every weight moved by seeded noise of `scale`
    times its own spread; returns `directory`."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    weights = load_file(Path(source) / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in sorted(weights.items()):
        spread = tensor.float().std() if tensor.numel() > 1 else tensor.float().abs()
        noise = torch.randn(tensor.shape, generator=generator) * spread * scale
        moved[name] = (tensor.float() + noise).to(tensor.dtype).contiguous()
    save_file(moved, str(Path(directory) / "model.safetensors"))
    return Path(directory)
