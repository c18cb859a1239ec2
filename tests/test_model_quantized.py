"""Weights kept quantized (model/weights/quantized.py, quantized_linear.py, csrc/quantized_matmul.cpp): the GGUF blocks
decode as the format's reference reader decodes them, the compiled matmul keeps each row's bits its own on every
variant, and an engine serving a GGUF quantized agrees with the float reference of the same weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf_helpers import (
    encode_tensor,
    gguf_tensors,
    random_blocks,
    random_hf_weights,
    tiny_llama_config,
    train_tokenizer,
    write_gguf,
)
from k_quants import encode_iq4_xs, encode_q2_k, encode_q3_k, encode_q4_k, encode_q6_k

from prefixserve import LLM, SamplingParams
from prefixserve.engine.model_version import weight_format
from prefixserve.model import kernels
from prefixserve.model.weights.gguf_blocks import from_gguf_blocks
from prefixserve.model.weights.quantized import QuantizedWeight, quantize
from prefixserve.model.weights.quantized_linear import QuantizedLinear
from prefixserve.model.weights.quantized_model import serve_quantized, weight_memory

Q = GGMLQuantizationType
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
# Bytes kept per 256 values for each 256 the file has: the K-quants' 6-bit scales and minimums a byte each
KEPT_PER_FILE = {"Q4_K": (148, 144), "Q5_K": (180, 176), "Q3_K": (114, 110), "IQ4_XS": (138, 136)}


def gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Bytes of a [rows, cols] tensor of `kind`: quantized by the format's writer, or random K-quant and IQ
    blocks."""
    if kind.endswith("_K") or kind.startswith("IQ"):
        return random_blocks(Q[kind], rows, cols, seed)
    values = np.random.default_rng(seed).normal(0, 0.05, size=(rows, cols)).astype(np.float32)
    return encode_tensor(values, Q[kind])


def decoded_by_kernel(compiled, weight: QuantizedWeight) -> torch.Tensor:
    return compiled.dequantize(*weight.kernel_arguments())


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_as_the_format_reader_decodes_them(kind):
    rows, cols = 6, 512
    raw = gguf_blocks(kind, rows, cols)
    expected = torch.from_numpy(gguf_dequantize(raw, Q[kind]).reshape(rows, cols).astype(np.float32))
    weight = from_gguf_blocks(kind, raw, rows, cols)
    assert weight.kind == kind and (weight.out_features, weight.in_features) == (rows, cols)
    kept, held = KEPT_PER_FILE.get(kind, (1, 1))  # the others: the file's bytes, some re-laid
    assert weight.nbytes * held == raw.nbytes * kept
    # The reader rounds a product and a sum where the kernel fuses them: one rounding apart at most.
    tolerance = dict(rtol=0, atol=float(expected.abs().max()) * 2**-22)
    torch.testing.assert_close(weight.dequantize(), expected, **tolerance)
    if kernels.compiled is not None:
        torch.testing.assert_close(decoded_by_kernel(kernels.compiled, weight), expected, **tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_multiplies_each_row_alone(kernel_variant, kind):
    # rows: not a whole number of the kernel's column tiles; cols: 24 groups, one whole chunk of 16
    # whose scales convert at once and a tail of 8 (K-quants' super-blocks need a multiple of 256)
    rows, cols = 70, 768
    weight = from_gguf_blocks(kind, gguf_blocks(kind, rows, cols, seed=1), rows, cols)
    decoded = decoded_by_kernel(kernel_variant, weight)
    x = torch.randn(75, cols, generator=torch.Generator().manual_seed(2))

    def multiply(block: torch.Tensor) -> torch.Tensor:
        return kernel_variant.quantized_matmul(block, *weight.kernel_arguments(), None)

    whole = multiply(x)
    exact = (x.double() @ decoded.double().T).float()
    assert torch.all((whole - exact).abs() <= 1e-5 * (x.abs() @ decoded.abs().T))  # float32 sums, any order
    for size in (1, 2, 3, 5, 8, 64, 75):  # tile tails and row chunks: every row computes as it does alone
        assert torch.equal(torch.cat([multiply(x[i : i + size]) for i in range(0, 75, size)]), whole), size
    strided = torch.randn(75, cols + 32)[:, :cols]
    strided.copy_(x)
    assert torch.equal(multiply(strided), whole)


def test_q4_k_scales_formed_from_the_file_bytes_are_the_float32_scales_bit_for_bit(kernel_variant):
    weight = from_gguf_blocks("Q4_K", gguf_blocks("Q4_K", 21, 768, seed=3), 21, 768)
    scales, offsets = weight.group_values()  # d * scale and -(dmin * min): exact float32 products
    as_floats = QuantizedWeight("Q4_K", weight.codes, scales.contiguous(), offsets.contiguous(), 4)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(4))
    for rows in (x[:1], x[:3], x):  # the fused decode path and the buffered one
        assert torch.equal(
            kernel_variant.quantized_matmul(rows, *weight.kernel_arguments(), None),
            kernel_variant.quantized_matmul(rows, *as_floats.kernel_arguments(), None),
        )
    assert torch.equal(decoded_by_kernel(kernel_variant, weight), decoded_by_kernel(kernel_variant, as_floats))
    bad = QuantizedWeight("Q4_K", weight.codes, weight.scales[:, :-2].contiguous(), weight.offsets, 4)
    with pytest.raises(RuntimeError, match=r"Q4_K \(Q5_K\) scales must be uint8"):
        kernel_variant.quantized_matmul(x, *bad.kernel_arguments(), None)


BAD_SCALES = {
    "Q6_K": "Q6_K scales must be uint8",
    "Q3_K": "Q3_K scales must be uint8",
    "Q2_K": "Q2_K scales must be uint8",
    "IQ4_NL": "scales and offsets must be contiguous",
    "IQ4_XS": "IQ4_XS scales must be uint8",
}


@pytest.mark.parametrize("kind", list(BAD_SCALES))
def test_kinds_of_exact_products_decode_to_the_format_readers_values_bit_for_bit(kernel_variant, kind):
    # d * scale is exact in float32 and so is its product with a 6-, 3- or 2-bit code (and Q2_K's offset
    # -(dmin * min)), or with an IQ4 level (8 bits): no rounding to differ in
    rows, cols = 21, 768
    raw = gguf_blocks(kind, rows, cols, seed=3)
    weight = from_gguf_blocks(kind, raw, rows, cols)
    expected = torch.from_numpy(gguf_dequantize(raw, Q[kind]).reshape(rows, cols).astype(np.float32))
    assert torch.equal(decoded_by_kernel(kernel_variant, weight), expected)
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(4))
    for size in (1, 3, 9):  # the fused decode path and the buffered one
        assert torch.equal(
            kernel_variant.quantized_matmul(x[:size], *weight.kernel_arguments(), None),
            kernel_variant.quantized_matmul(x, *weight.kernel_arguments(), None)[:size],
        )
    bad = replace(weight, scales=weight.scales[:, :-2].contiguous())
    with pytest.raises(RuntimeError, match=BAD_SCALES[kind]):
        kernel_variant.quantized_matmul(x, *bad.kernel_arguments(), None)
    with pytest.raises(RuntimeError, match=f"zero_point {weight.zero_point}"):
        kernel_variant.quantized_matmul(x, *replace(weight, zero_point=weight.zero_point + 1).kernel_arguments(), None)


def test_a_zero_point_decodes_exactly_and_only_a_power_of_two_without_offsets_is_taken(kernel_variant):
    # The kernels may fold the zero point into the offset, exact for these weights only; scale (code - zero_point)
    # is an exact product here, so the decode must equal the reference's bit for bit, at any such zero point.
    q4_0 = from_gguf_blocks("Q4_0", gguf_blocks("Q4_0", 10, 96, seed=6), 10, 96)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
    for zero_point in (8, 4, 16, 1):
        weight = replace(q4_0, zero_point=zero_point)
        assert torch.equal(decoded_by_kernel(kernel_variant, weight), weight.dequantize()), zero_point
        for size in (1, 5):  # the fused decode path and the buffered one
            assert torch.equal(
                kernel_variant.quantized_matmul(x[:size], *weight.kernel_arguments(), None),
                kernel_variant.quantized_matmul(x, *weight.kernel_arguments(), None)[:size],
            )
    q4_1 = from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", 10, 96, seed=6), 10, 96)
    for bad in (replace(q4_0, zero_point=6), replace(q4_0, zero_point=-8), replace(q4_1, zero_point=8)):
        with pytest.raises(RuntimeError, match="zero_point must be 0, or a power of two for a weight without offsets"):
            kernel_variant.quantized_matmul(x, *bad.kernel_arguments(), None)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_rounds_each_value_to_its_nearest_code(bits):
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(3))
    weight[0, :32] = 0  # an all-zero group has scale 0 and decodes to zeros
    quantized = quantize(weight, bits)
    assert quantized.kind == ("Q8_0" if bits == 8 else "Q4_1")
    step = quantized.scales.float().repeat_interleave(32, dim=1)
    error = (quantized.dequantize() - weight).abs()
    assert torch.all(error <= step * 0.5 + 1e-6 + step * 2**-10)  # half a step, and the float16 scale's rounding
    assert torch.equal(quantized.dequantize()[0, :32], torch.zeros(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), bits)


def test_the_pure_pytorch_path_keeps_rows_independent(monkeypatch):
    weight = from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", 40, 64, seed=4), 40, 64)
    layer = QuantizedLinear([weight], bias=torch.randn(40))
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(5))
    expected = x @ weight.dequantize().T + layer.bias
    monkeypatch.setattr(kernels, "compiled", None)
    layer.plan_rows(batch_invariant=True, max_rows=64)
    whole = layer(x)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(33)]), whole)


def test_mixed_layouts_of_one_projection_stay_apart_and_in_order():
    parts = [
        from_gguf_blocks("Q4_K", gguf_blocks("Q4_K", 8, 256), 8, 256),
        from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", 8, 256, seed=1), 8, 256),
        from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", 4, 256, seed=2), 4, 256),
    ]
    layer = QuantizedLinear(parts)
    assert layer.kinds == ["Q4_K", "Q4_1"] and layer.out_features == 20
    x = torch.randn(3, 256)
    decoded = torch.cat([part.dequantize() for part in parts])
    exact = (x.double() @ decoded.double().T).float()
    assert torch.all((layer(x) - exact).abs() <= 1e-5 * (x.abs() @ decoded.abs().T))


# ------------------------------------------------------------------ served through the engine
@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """A 2-layer llama GGUF laid out as llama.cpp's mixed files are: Q8_0 embedding, Q4_1 attention, Q4_0 MLP."""
    tokenizer = train_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    stored = gguf_tensors(config, random_hf_weights(config, seed=4))
    kinds = {
        name: (Q.Q8_0 if name in ("token_embd.weight", "output.weight") else Q.Q4_1 if ".attn_" in name else Q.Q4_0)
        for name, value in stored.items()
        if value.ndim == 2
    }
    return write_gguf(tmp_path_factory.mktemp("quantized") / "mixed.gguf", config, stored, kinds, tokenizer=tokenizer)


@pytest.fixture(scope="module", params=["Q4_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS"])
def k_quant_gguf(request, tmp_path_factory):
    """A 2-layer llama GGUF mixed as llama.cpp's Q4_K_M, Q5_K_M, Q3_K_M, Q2_K and IQ4_XS files are: Q4_K (Q5_K,
    Q3_K, Q2_K, IQ4_XS) projections, Q6_K for attn_v, ffn_down, the embedding and the output (rows of 256
    values: K-quants' super-blocks)."""
    tokenizer = train_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer[0])) | {
        "hidden_size": 256,
        "intermediate_size": 512,
        "head_dim": 64,
    }
    stored = gguf_tensors(config, random_hf_weights(config, seed=5))
    six = ("token_embd.weight", "output.weight", "attn_v.weight", "ffn_down.weight")
    kinds, tensors = {}, {}
    for name, value in stored.items():
        if value.ndim == 2:
            kinds[name] = Q.Q6_K if name.endswith(six) else Q[request.param]
            encode = {
                "Q4_K": encode_q4_k,
                "Q5_K": lambda value: encode_q4_k(value, bits=5),
                "Q3_K": encode_q3_k,
                "Q2_K": encode_q2_k,
                "IQ4_XS": encode_iq4_xs,
            }[request.param]
            value = encode_q6_k(value) if kinds[name] == Q.Q6_K else encode(value)
        tensors[name] = value
    path = tmp_path_factory.mktemp("k_quants") / f"{request.param}_M.gguf"
    return write_gguf(path, config, tensors, kinds, tokenizer=tokenizer)


PROMPTS = [
    "The capital of France is",
    "Hello world! Hello there",
    "def main():\n    return",
    "In 2024 there were 365 days",
    "naïve café Zürich",
    "3.14159 is close to",
]


def generate(llm: LLM, prompts: list[str], max_tokens: int = 24) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [list(output.token_ids) for output in outputs]


def test_a_gguf_is_served_quantized_and_agrees_with_its_float_reference(quantized_gguf):
    quantized = LLM(str(quantized_gguf), kv_cache_memory_bytes=16 << 20, log_stats=False)
    reference = LLM(
        str(quantized_gguf), dequantize=True, dtype="float32", kv_cache_memory_bytes=16 << 20, log_stats=False
    )
    engine, float_engine = quantized.engine, reference.engine
    assert engine.weights == "gguf" and float_engine.weights == "float" and engine.dtype == torch.float32
    assert engine.scope.model_fingerprint != float_engine.scope.model_fingerprint  # their KV is not shared
    memory = weight_memory(engine.version.model)
    assert memory.kinds == ("Q4_0", "Q4_1", "Q8_0")
    assert memory.resident_bytes <= 1.1 * quantized_gguf.stat().st_size
    ours, theirs = generate(quantized, PROMPTS), generate(reference, PROMPTS)
    agreeing = sum(a == b for mine, other in zip(ours, theirs) for a, b in zip(mine, other))
    assert agreeing >= 0.99 * sum(len(tokens) for tokens in theirs)
    assert [tokens[0] for tokens in ours] == [tokens[0] for tokens in theirs]


def test_a_k_quant_gguf_keeps_its_blocks_at_the_files_size_and_agrees_with_its_float_reference(k_quant_gguf):
    quantized = LLM(str(k_quant_gguf), kv_cache_memory_bytes=16 << 20, log_stats=False)
    reference = LLM(
        str(k_quant_gguf), dequantize=True, dtype="float32", kv_cache_memory_bytes=16 << 20, log_stats=False
    )
    memory = weight_memory(quantized.engine.version.model)
    assert memory.kinds == (k_quant_gguf.stem.removesuffix("_M"), "Q6_K")  # nothing requantized to int8
    assert memory.resident_bytes <= 1.1 * k_quant_gguf.stat().st_size
    ours, theirs = generate(quantized, PROMPTS), generate(reference, PROMPTS)
    agreeing = sum(a == b for mine, other in zip(ours, theirs) for a, b in zip(mine, other))
    assert agreeing >= 0.99 * sum(len(tokens) for tokens in theirs)
    assert [tokens[0] for tokens in ours] == [tokens[0] for tokens in theirs]


def test_cache_hits_never_change_a_quantized_output(quantized_gguf):
    shared = "The capital of France is Paris. The capital of Italy is Rome. " * 3
    prompts = [shared + tail for tail in PROMPTS]
    cached = LLM(str(quantized_gguf), kv_cache_memory_bytes=16 << 20, log_stats=False)
    uncached = LLM(str(quantized_gguf), enable_prefix_caching=False, kv_cache_memory_bytes=16 << 20, log_stats=False)
    first = generate(cached, prompts)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    again = cached.generate(prompts[::-1], params)[::-1]  # every prompt now hits, batched otherwise
    assert all(output.num_cached_tokens >= 48 for output in again)
    assert [list(output.token_ids) for output in again] == first
    assert generate(uncached, prompts) == first


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantize_holds_a_float_checkpoint_at_that_width(default_model_dir, bits):
    llm = LLM(str(default_model_dir), quantize=bits, kv_cache_memory_bytes=16 << 20, log_stats=False)
    memory = weight_memory(llm.engine.version.model)
    float_bytes = sum(file.stat().st_size for file in default_model_dir.glob("*.safetensors"))
    assert memory.resident_bytes < float_bytes / (3.5 if bits == "int8" else 5)
    assert memory.kinds == (("Q8_0",) if bits == "int8" else ("Q4_1", "Q8_0"))  # lm_head (and the embedding): int8
    assert all(len(tokens) == 8 for tokens in generate(llm, PROMPTS[:2], max_tokens=8))


def test_contradicting_or_impossible_options_name_the_fix(quantized_gguf, default_model):
    with pytest.raises(ValueError, match="contradict"):
        LLM(str(quantized_gguf), quantize="int8", dequantize=True)
    with pytest.raises(ValueError, match="quantize must be one of"):
        LLM(str(quantized_gguf), quantize="int3")
    with pytest.raises(ValueError, match="CPU only"):
        serve_quantized(default_model, "int8", None, torch.device("cuda"))
    # Off the CPU a GGUF is decoded to float as before; on it, it keeps its blocks unless asked otherwise.
    assert weight_format(str(quantized_gguf), device=torch.device("cuda")) == "float"
    assert weight_format(str(quantized_gguf), device=torch.device("cpu")) == "gguf"
    assert weight_format(str(quantized_gguf), dequantize=True) == "float"
    assert weight_format(None, quantize="int4", device=torch.device("cpu")) == "int4"


def test_a_gguf_of_float_weights_only_is_served_as_floats(tmp_path, quantized_gguf):
    """An F32 export holds nothing to keep quantized: it is served as floats (as llama.cpp serves it),
    not requantized to int8; one quantized 2-D tensor makes the file a quantized one."""
    tokenizer = train_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    stored = gguf_tensors(config, random_hf_weights(config, seed=5))
    float_file = write_gguf(tmp_path / "f32.gguf", config, stored, tokenizer=tokenizer)
    assert weight_format(str(float_file), device=torch.device("cpu")) == "float"
    one_quantized = write_gguf(
        tmp_path / "one.gguf", config, stored, {"blk.0.ffn_down.weight": GGMLQuantizationType.Q8_0}, tokenizer=tokenizer
    )
    assert weight_format(str(one_quantized), device=torch.device("cpu")) == "gguf"
    served = LLM(str(float_file), kv_cache_memory_bytes=16 << 20, log_stats=False)
    assert not any(isinstance(module, QuantizedLinear) for module in served.engine.version.model.modules())
    decoded = LLM(str(float_file), dequantize=True, kv_cache_memory_bytes=16 << 20, log_stats=False)
    assert generate(served, PROMPTS[:2], max_tokens=8) == generate(decoded, PROMPTS[:2], max_tokens=8)
