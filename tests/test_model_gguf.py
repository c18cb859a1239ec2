"""GGUF conversion: every supported tensor type decodes to a reference, a llama.cpp-style file
converts back to the exact Hugging Face weights, and loads in prefixserve and transformers alike."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize, quantize
from gguf_helpers import (
    Q,
    gguf_tensors,
    random_blocks,
    random_hf_weights,
    tiny_llama_config,
    train_tokenizer,
    transformers_gguf_model,
    write_gguf,
    write_tiny_llama_gguf,
)
from model_helpers import PagedSequences
from safetensors.numpy import load_file

from prefixserve.model import Tokenizer, load_model
from prefixserve.model.weights import gguf as gguf_module
from prefixserve.model.weights.gguf import SOURCE_FILE, convert_gguf, gguf_fingerprint, read_gguf_source
from prefixserve.model.weights.gguf_checkpoint import SUPPORTED_TENSOR_TYPES, TensorPlan, load_tensor

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """A 2-layer llama GGUF in float32 and the Hugging Face weights it was written from."""
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return path, config, random_hf_weights(config)


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


# ---- tensor types --------------------------------------------------------------------------------


def _decode_one(tmp_path: Path, data: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray]:
    """Write one (rows, cols) tensor of ``kind``, read it back through the converter: (ours, raw bytes)."""
    name = "blk.0.ffn_up.weight"
    path = write_gguf(tmp_path / f"{kind.name}.gguf", tiny_llama_config(32), {name: data}, {name: kind})
    tensor = GGUFReader(path).tensors[0]
    assert tensor.tensor_type == kind
    shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
    return load_tensor(TensorPlan("x", shape, tensor, None)), tensor.data


def _reference_block_decode(raw: np.ndarray, kind) -> np.ndarray:
    """The block formats spelled out (ggml-quants.c dequantize_row_*), independently of gguf.quants."""
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24}[kind]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == Q.Q8_0:  # d, 32 x int8
        return (d * blocks[:, 2:].copy().view(np.int8)).reshape(raw.shape[0], -1)
    if kind in (Q.Q4_1, Q.Q5_1):
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        rest = blocks[:, 4:]
    else:
        rest = blocks[:, 2:]
    if kind in (Q.Q5_0, Q.Q5_1):  # 32 high bits in a uint32, then the nibbles
        high_bits = rest[:, 0:4].copy().view("<u4")
        high = ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        rest = rest[:, 4:]
    else:
        high = np.zeros((len(blocks), 32), np.uint8)
    # nibbles: low halves are values 0..15 of the block, high halves values 16..31
    q = np.concatenate([rest & 0x0F, rest >> 4], axis=1) | (high << 4)
    if kind in (Q.Q4_1, Q.Q5_1):
        values = d * q.astype(np.float32) + m
    else:
        values = d * (q.astype(np.float32) - (8 if kind == Q.Q4_0 else 16))
    return values.reshape(raw.shape[0], -1)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda kind: kind.name)
def test_block_quants_decode_like_the_format_spec(tmp_path, kind):
    values = np.random.default_rng(1).standard_normal((8, 128)).astype(np.float32)
    ours, raw = _decode_one(tmp_path, quantize(values, kind), kind)
    assert ours.shape == (8, 128) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, _reference_block_decode(raw, kind))
    np.testing.assert_array_equal(ours, dequantize(raw, kind))
    assert np.abs(ours - values).max() < 0.35  # and it is the tensor that was quantized


IQ_TYPES = [Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M]


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, *IQ_TYPES], ids=lambda kind: kind.name)
def test_k_quants_and_iq_types_decode_like_an_independent_implementation(tmp_path, kind):
    # gguf cannot quantize to K-quants or IQ types; random blocks (with finite scales) exercise every bit.
    # transformers' torch decoder (from ComfyUI-GGUF) is a separate implementation of the format.
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    ours, raw = _decode_one(tmp_path, random_blocks(kind, 4, 512), kind)
    assert ours.shape == (4, 512) and np.isfinite(ours).all() and np.abs(ours).max() > 0
    np.testing.assert_array_equal(ours, dequantize(raw, kind))
    theirs = dequant.dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(kind)).reshape(4, 512)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16], ids=lambda kind: kind.name)
def test_float_types_decode_exactly(tmp_path, kind):
    values = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    data = {Q.F32: values, Q.F16: values.astype(np.float16), Q.BF16: quantize(values, Q.BF16)}[kind]
    ours, raw = _decode_one(tmp_path, data, kind)
    if kind == Q.BF16:  # bfloat16 is the top half of a float32
        expected = (raw.copy().view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        expected = data.astype(np.float32)
    np.testing.assert_array_equal(ours, expected)


def test_every_supported_type_is_tested():
    tested = {
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.F32,
        Q.F16,
        Q.BF16,
        *IQ_TYPES,
    }
    assert set(SUPPORTED_TENSOR_TYPES) == tested


# ---- a whole model -------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_float32_file_converts_back_to_the_exact_weights(tmp_path, tokenizer, tie):
    config = tiny_llama_config(vocab_size=len(tokenizer[0]), tie=tie)
    weights = random_hf_weights(config, seed=3)
    path = write_gguf(tmp_path / "model.gguf", config, gguf_tensors(config, weights), tokenizer=tokenizer)
    converted = convert_gguf(path, tmp_path / "cache")

    loaded = load_file(converted / "model.safetensors")
    assert sorted(loaded) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    written = json.loads((converted / "config.json").read_text())
    for key, value in config.items():
        assert written[key] == value, key
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_tiny_model_matches_transformers_gguf_load(tiny, cache):
    path, config, _ = tiny
    converted = convert_gguf(path, cache)
    reference = transformers_gguf_model(path)
    for name, value in load_file(converted / "model.safetensors").items():
        assert torch.equal(torch.from_numpy(value), reference.state_dict()[name]), name

    ours = load_model(converted, torch.float32, CPU)
    prompt = [5, 80, 17, 200, 33, 9, 150, 77, 3, 41, 250, 12, 99, 8, 60, 61, 62, 300, 7]
    logits = PagedSequences(ours.model).step([prompt], [0], [[0, 1]])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert logits.std() > 1  # well separated: a wrong row order would not pass at this tolerance


def test_quantized_model_matches_transformers_gguf_load(tmp_path, tokenizer):
    # Quantized Q/K rows go through the same un-permutation as float ones.
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    stored = gguf_tensors(config, random_hf_weights(config, seed=4))
    kinds = {
        name: (Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1 if ".attn_" in name else Q.Q4_0)
        for name, value in stored.items()
        if value.ndim == 2
    }
    path = write_gguf(tmp_path / "q.gguf", config, stored, kinds, tokenizer=tokenizer)
    converted = convert_gguf(path, tmp_path / "cache")
    reference = transformers_gguf_model(path).state_dict()
    for name, value in load_file(converted / "model.safetensors").items():
        assert torch.equal(torch.from_numpy(value), reference[name]), name
    assert read_gguf_source(converted)["tensor_types"] == ["F32", "Q4_0", "Q4_1", "Q8_0"]


def converted_exactly(tmp_path, tokenizer, model_type: str, seed: int, tie: bool, architecture: str):
    """(config, weights, GGUF path, converted directory) of a float32 GGUF of `model_type`, after checking the
    conversion gave back exactly the weights written and the Hugging Face architecture."""
    config = tiny_llama_config(vocab_size=len(tokenizer[0]), tie=tie, model_type=model_type)
    weights = random_hf_weights(config, seed=seed)
    path = write_gguf(
        tmp_path / f"{model_type}.gguf", config, gguf_tensors(config, weights), tokenizer=tokenizer, pre="qwen2"
    )
    converted = convert_gguf(path, tmp_path / "cache")
    loaded = load_file(converted / "model.safetensors")
    assert sorted(loaded) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert json.loads((converted / "config.json").read_text())["architectures"] == [architecture]
    return config, weights, path, converted


def test_qwen2_file_keeps_its_row_order_and_biases(tmp_path, tokenizer):
    *_, converted = converted_exactly(tmp_path, tokenizer, "qwen2", seed=5, tie=True, architecture="Qwen2ForCausalLM")
    load_model(converted, torch.float32, CPU)  # biases and tied embeddings fit our model


def test_qwen3_file_keeps_its_head_norms_and_matches_transformers(tmp_path, tokenizer):
    config, weights, path, converted = converted_exactly(
        tmp_path, tokenizer, "qwen3", seed=6, tie=False, architecture="Qwen3ForCausalLM"
    )
    ours = load_model(converted, torch.float32, CPU)
    prompt = [5, 80, 17, 200, 33, 9, 150, 77, 3, 41, 250, 12, 99, 8, 60, 61, 62, 300, 7]
    logits = PagedSequences(ours.model).step([prompt], [0], [[0, 1]])
    # transformers' own GGUF reader takes Qwen3's head_dim from its config default, not the file's key_length:
    # the reference is transformers' Qwen3 built from the original config and weights instead.
    transformers = pytest.importorskip("transformers")
    reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).eval()
    reference.load_state_dict({name: torch.from_numpy(value) for name, value in weights.items()})
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    broken = {
        name: value for name, value in gguf_tensors(config, weights).items() if name != "blk.1.attn_k_norm.weight"
    }
    with pytest.raises(ValueError, match="missing 1 tensors .*model.layers.1.self_attn.k_norm.weight"):
        convert_gguf(
            write_gguf(tmp_path / "broken.gguf", config, broken, tokenizer=tokenizer, pre="qwen2"), tmp_path / "cache"
        )


# ---- errors --------------------------------------------------------------------------------------


def test_unsupported_tensor_type_names_it_and_the_supported_ones(tmp_path, tokenizer):
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    stored = gguf_tensors(config, random_hf_weights(config))
    stored["blk.1.ffn_up.weight"] = random_blocks(Q.Q8_1, 128, 64)  # llama.cpp's activation blocks
    path = write_gguf(tmp_path / "q8_1.gguf", config, stored, {"blk.1.ffn_up.weight": Q.Q8_1}, tokenizer=tokenizer)
    with pytest.raises(
        ValueError,
        match=r"'blk.1.ffn_up.weight' has type Q8_1.*supported: F32, F16, BF16, "
        r"Q8_0, Q4_0, Q4_1.*Q6_K, IQ4_NL",
    ):
        convert_gguf(path, tmp_path / "cache")
    assert not [entry for entry in (tmp_path / "cache" / "gguf").iterdir() if entry.is_dir()]  # no debris


@pytest.mark.parametrize("cut", [-100, 1000, 10], ids=["in-tensor-data", "in-token-list", "in-header"])
def test_truncated_file_is_a_clear_error(tmp_path, tiny, cut):
    data = tiny[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"cut.gguf is not a (readable|valid) GGUF file .*download it again"):
        convert_gguf(path, tmp_path / "cache")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights\n" * 10)
    with pytest.raises(ValueError, match="notes.gguf is not a readable GGUF file"):
        convert_gguf(path, tmp_path / "cache")


def test_unsupported_architecture(tmp_path, tiny):
    config = dict(tiny[1], model_type="gemma2")
    path = write_gguf(tmp_path / "gemma.gguf", config, {"token_embd.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ValueError, match=r"architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3"):
        convert_gguf(path, tmp_path / "cache")


@pytest.mark.parametrize(
    "extra, tensor, message",
    [
        ({"split.count": (2, GGUFValueType.UINT16)}, None, "one part of a split GGUF; merge the parts first"),
        ({"llama.rope.scaling.type": ("yarn", GGUFValueType.STRING)}, None, "rope scaling 'yarn' is not supported"),
        ({}, "rope_freqs.weight", r"rope factors \(rope_freqs.weight, Llama 3.1 style"),
        ({"llama.rope.dimension_count": (8, GGUFValueType.UINT32)}, None, "partial rotary embeddings"),
        ({}, "blk.0.attn_sinks.weight", "tensor 'blk.0.attn_sinks.weight' has no Hugging Face counterpart"),
    ],
    ids=["split", "yarn", "rope-freqs", "partial-rotary", "unknown-tensor"],
)
def test_unsupported_model_features_are_named(tmp_path, tiny, tokenizer, extra, tensor, message):
    config = tiny[1]
    stored = gguf_tensors(config, tiny[2])
    if tensor is not None:
        stored[tensor] = np.ones(8, np.float32)
    path = write_gguf(tmp_path / "odd.gguf", config, stored, tokenizer=tokenizer, extra=extra)
    with pytest.raises(ValueError, match=message):
        convert_gguf(path, tmp_path / "cache")


def test_linear_rope_scaling_is_carried_over(tmp_path, tiny, tokenizer):
    extra = {
        "llama.rope.scaling.type": ("linear", GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
    }
    path = write_gguf(
        tmp_path / "linear.gguf", tiny[1], gguf_tensors(tiny[1], tiny[2]), tokenizer=tokenizer, extra=extra
    )
    config = json.loads((convert_gguf(path, tmp_path / "cache") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_directory_must_hold_exactly_one_gguf(tmp_path, tiny):
    with pytest.raises(ValueError, match="holds 0 .gguf files"):
        convert_gguf(tmp_path, tmp_path / "cache")
    shutil.copy(tiny[0], tmp_path / "a.gguf")
    assert convert_gguf(tmp_path, tmp_path / "cache") == convert_gguf(tiny[0], tmp_path / "cache")
    shutil.copy(tiny[0], tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 .gguf files \(a.gguf, b.gguf\); name the file"):
        convert_gguf(tmp_path, tmp_path / "cache")


# ---- the conversion cache ------------------------------------------------------------------------


def test_second_call_reuses_the_conversion_and_the_hash(tmp_path, tiny, monkeypatch):
    path = Path(shutil.copy(tiny[0], tmp_path / "model.gguf"))
    first = convert_gguf(path, tmp_path / "cache")
    record = read_gguf_source(first)
    assert first == tmp_path / "cache" / "gguf" / record["sha256"][:16]
    assert record["file"] == "model.gguf" and record["converter_version"] == gguf_module.CONVERTER_VERSION

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "write_hf_checkpoint", fail)
    # Same path, size and mtime: the remembered hash is used without reading the file, which the
    # overwritten (same-size) content would betray.
    stat = path.stat()
    path.write_bytes(bytes(stat.st_size))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert convert_gguf(path, tmp_path / "cache") == first


def test_changed_file_or_converter_converts_again(tmp_path, tiny, tokenizer, monkeypatch):
    path = Path(shutil.copy(tiny[0], tmp_path / "model.gguf"))
    first = convert_gguf(path, tmp_path / "cache")
    config = tiny[1]
    write_gguf(path, config, gguf_tensors(config, random_hf_weights(config, seed=9)), tokenizer=tokenizer)
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    second = convert_gguf(path, tmp_path / "cache")
    assert second != first and gguf_fingerprint(second) != gguf_fingerprint(first)

    monkeypatch.setattr(gguf_module, "CONVERTER_VERSION", gguf_module.CONVERTER_VERSION + 1)
    fingerprint = gguf_fingerprint(second)
    assert convert_gguf(path, tmp_path / "cache") == second
    assert read_gguf_source(second)["converter_version"] == gguf_module.CONVERTER_VERSION
    assert gguf_fingerprint(second) != fingerprint


def test_fingerprint_follows_the_file_not_its_path(tmp_path, tiny, default_model_dir):
    copy = Path(shutil.copy(tiny[0], tmp_path / "elsewhere.gguf"))
    first, second = convert_gguf(copy, tmp_path / "a"), convert_gguf(tiny[0], tmp_path / "b")
    assert gguf_fingerprint(first) == gguf_fingerprint(second)
    assert gguf_fingerprint(default_model_dir) is None
    # The conversion is deterministic, which is what lets the file's hash stand for the weights.
    for file in sorted(first.iterdir()):
        if file.name != SOURCE_FILE:
            assert file.read_bytes() == (second / file.name).read_bytes(), file.name
    assert Tokenizer.from_dir(first).fingerprint != Tokenizer.from_dir(default_model_dir).fingerprint
