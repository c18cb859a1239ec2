"""Checkpoint loading: errors name their cause, fingerprints follow content, the default model
is byte-for-byte reproducible."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from model_helpers import gemma2_config, phi3_config, phi4_mini_config, qwen2_config, write_random_checkpoint
from safetensors.torch import load_file, save_file

from prefixserve.model import ModelConfig, ensure_default_model, load_generation_eos, load_model
from prefixserve.model.weights import hf_loader as loader

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("small") / "qwen2", qwen2_config(vocab_size=64))


@pytest.fixture
def checkpoint_copy(small_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(small_checkpoint, tmp_path / "copy"))


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ---- errors --------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*config.json and \\*.safetensors"):
        load_model(missing, torch.float32, CPU)


def test_missing_config(checkpoint_copy):
    (checkpoint_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_model(checkpoint_copy, torch.float32, CPU)


def test_missing_weights(checkpoint_copy):
    (checkpoint_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(checkpoint_copy, torch.float32, CPU)


def test_unsupported_architecture(checkpoint_copy):
    _edit_config(checkpoint_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        load_model(checkpoint_copy, torch.float32, CPU)


def test_shape_mismatch_names_tensor_and_shapes(checkpoint_copy):
    _edit_config(checkpoint_copy, intermediate_size=128)  # the weights were made for 256
    with pytest.raises(
        ValueError,
        match=r"shape mismatch for 'model.layers.0.mlp.down_proj.weight': "
        r"expected \(128, 128\).*has \(128, 256\)",
    ):
        load_model(checkpoint_copy, torch.float32, CPU)


def test_unexpected_and_missing_tensors(checkpoint_copy):
    weights = load_file(checkpoint_copy / "model.safetensors")
    weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(weights, checkpoint_copy / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(checkpoint_copy, torch.float32, CPU)
    del weights["model.layers.0.mlp.extra.weight"], weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, checkpoint_copy / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 tensors: model.layers.1.self_attn.k_proj.bias"):
        load_model(checkpoint_copy, torch.float32, CPU)


def test_config_validation_names_field():
    config = qwen2_config()
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        ModelConfig.from_hf_dict({**config, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        ModelConfig.from_hf_dict({key: value for key, value in config.items() if key != "hidden_size"})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelConfig.from_hf_dict({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_config_reads_transformers5_rope_parameters():
    config = ModelConfig.from_hf_dict(
        {
            **qwen2_config(),
            "rope_theta": None,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        }
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["original_max_position_embeddings"] == 512  # defaults like transformers
    assert config.attention_bias and not config.o_proj_bias  # Qwen2: bias on q/k/v only


def test_longrope_and_partial_rotary_configs_are_read_and_checked():
    config = ModelConfig.from_hf_dict(phi4_mini_config())
    assert config.rotary_dim == 24 and config.long_rope_after == 24
    assert config.rope_scaling["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="long_factor must be 12 positive numbers"):
        ModelConfig.from_hf_dict(
            {
                **phi4_mini_config(),
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 12, "long_factor": [1.0] * 16},
            }
        )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.8 gives 25 rotary dims"):
        ModelConfig.from_hf_dict({**phi4_mini_config(), "partial_rotary_factor": 0.8})
    with pytest.raises(ValueError, match="attn_logit_softcapping=0.0"):
        ModelConfig.from_hf_dict({**gemma2_config(), "attn_logit_softcapping": 0.0})
    assert ModelConfig.from_hf_dict(phi3_config()).long_rope_after is None


# ---- loading and fingerprints ---------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_single_file(small_checkpoint, tmp_path):
    sharded = Path(shutil.copytree(small_checkpoint, tmp_path / "sharded"))
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, sharded / file)
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    single = load_model(small_checkpoint, torch.float32, CPU).model.state_dict()
    split = load_model(sharded, torch.float32, CPU).model.state_dict()
    assert single.keys() == split.keys()
    for name in single:
        assert torch.equal(single[name], split[name]), name


def test_fingerprint_follows_weights_and_config(small_checkpoint, checkpoint_copy):
    original = load_model(small_checkpoint, torch.float32, CPU).model_fingerprint
    assert len(original) == 64 and int(original, 16) >= 0
    assert load_model(checkpoint_copy, torch.float32, CPU).model_fingerprint == original  # path-independent

    weights = load_file(checkpoint_copy / "model.safetensors")
    weights["model.norm.weight"][0] += 1e-3
    save_file(weights, checkpoint_copy / "model.safetensors", metadata={"format": "pt"})
    changed_weight = load_model(checkpoint_copy, torch.float32, CPU).model_fingerprint
    assert changed_weight != original

    _edit_config(checkpoint_copy, rms_norm_eps=1e-5)
    assert load_model(checkpoint_copy, torch.float32, CPU).model_fingerprint not in (original, changed_weight)


def test_large_files_are_fingerprinted_by_header_and_samples(small_checkpoint, checkpoint_copy, monkeypatch):
    monkeypatch.setattr(loader, "FULL_HASH_LIMIT", 1024)  # treat the small file as "large"
    monkeypatch.setattr(loader, "SAMPLE_SIZE", 256)
    files = loader.find_weight_files(checkpoint_copy)
    sampled = loader.model_fingerprint({}, files)
    assert sampled == loader.model_fingerprint({}, loader.find_weight_files(small_checkpoint))
    # Sample 0 starts at byte 0, so the header is always covered; change a byte in sample 1.
    data = bytearray(files[0].read_bytes())
    step = (len(data) - loader.SAMPLE_SIZE) // (loader.NUM_SAMPLES - 1)
    data[step + 5] ^= 0xFF
    files[0].write_bytes(bytes(data))
    assert loader.model_fingerprint({}, files) != sampled


def test_generation_eos(default_model_dir, checkpoint_copy):
    assert load_generation_eos(default_model_dir) == [1, 3]  # <|end_of_text|>, <|im_end|>
    assert load_generation_eos(checkpoint_copy) == [1]  # no generation_config.json: config.json


# ---- the default model ----------------------------------------------------------------------------


def test_default_model_is_reproducible_bytes(default_model_dir, tmp_path):
    fresh = ensure_default_model(tmp_path / "cache")
    assert fresh == tmp_path / "cache" / "prefixserve-tiny-v1"
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (fresh / name).read_bytes() == (default_model_dir / name).read_bytes(), name


def test_default_model_generation_is_race_safe(tmp_path):
    results, errors = [], []

    def generate():
        try:
            results.append(ensure_default_model(tmp_path))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prefixserve-tiny-v1"]  # no staging left


def test_default_model_config(default_model):
    config = default_model.config
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.max_position_embeddings,
    ) == (512, 8, 8, 4, 64, 1344, 8192, 4096)
    num_params = sum(p.numel() for p in default_model.model.parameters())
    assert 30e6 < num_params < 32e6
