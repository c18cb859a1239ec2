"""Two versions of the built-in model with the same KV layout, and their cold greedy answers."""

from __future__ import annotations

from pathlib import Path

from conftest import make_llm

from prefixserve.model.weights.versions import write_model_version


def two_versions(
    default_model_dir: Path, directory: Path, seed: int, prompts: list[str], greedy: dict
) -> tuple[Path, dict]:
    """(the perturbed copy's path, {path: cold greedy token ids per prompt} for both versions)."""
    from prefixserve import SamplingParams

    path_b = write_model_version(default_model_dir, directory, seed=seed)
    cold = {}
    for path in (default_model_dir, path_b):
        llm = make_llm(model=str(path), enable_prefix_caching=False)
        cold[path] = [out.token_ids for out in llm.generate(prompts, SamplingParams(**greedy))]
    assert cold[default_model_dir] != cold[path_b], "the perturbed copy must answer differently"
    return path_b, cold
