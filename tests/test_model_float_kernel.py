"""float32 weights multiplied by our compiled kernel (csrc/quantized_matmul.cpp's bits 32, model/linear.py's
use_kernel): the float64 reference's values, each row's bits its own whatever else is in the call, the weight
read in place; what the binding cannot read is refused by name; the compiled decoder stack takes such a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.model import linear
from prefixserve.model.families import decoder_stack
from prefixserve.model.linear import Linear, pack_linears
from prefixserve.model.weights.quantized import float32_kernel_arguments

EMPTY = torch.empty(0)
NO_LEVELS = torch.empty(0, dtype=torch.int8)


def test_a_float32_weight_multiplies_as_float64_does_and_each_rows_bits_are_its_own(kernel_variant):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=generator)  # rows not whole tiles of 4
    bias = torch.randn(37, generator=generator)
    x = torch.randn(75, 96, generator=generator)
    whole = kernel_variant.quantized_matmul(x, *float32_kernel_arguments(weight), bias)
    expected = (x.double() @ weight.double().T + bias.double()).float()
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-4)
    for count in (1, 2, 3, 4, 5, 16, 64, 65):  # decode steps (streamed), tiles, chunks of 64 and more
        for first in range(0, 75, count):
            part = kernel_variant.quantized_matmul(x[first : first + count], *float32_kernel_arguments(weight), bias)
            assert torch.equal(part, whole[first : first + count]), (count, first)
    strided = torch.zeros(75, 128)
    strided[:, :96] = x
    assert torch.equal(kernel_variant.quantized_matmul(strided[:, :96], *float32_kernel_arguments(weight), bias), whole)
    assert torch.equal(kernel_variant.dequantize(*float32_kernel_arguments(weight)), weight)


def test_a_float32_weight_the_kernel_cannot_read_is_refused_by_name(kernel_variant):
    weight = torch.randn(4, 64)
    codes = weight.view(torch.uint8)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="takes no scales, offsets, levels or zero point"):
        kernel_variant.quantized_matmul(x, codes, torch.ones(4, 2), EMPTY, 32, 32, 0, NO_LEVELS, None)
    with pytest.raises(RuntimeError, match="takes no scales, offsets, levels or zero point"):
        kernel_variant.quantized_matmul(x, codes, EMPTY, EMPTY, 32, 32, 8, NO_LEVELS, None)
    narrow = torch.randn(4, 48)
    with pytest.raises(RuntimeError, match="cols a multiple of 32"):
        kernel_variant.quantized_matmul(torch.randn(2, 48), *float32_kernel_arguments(narrow), None)
    misaligned = torch.zeros(4 * 256 + 1, dtype=torch.uint8)[1:].view(4, 256)
    with pytest.raises(RuntimeError, match="its values' bytes"):
        kernel_variant.quantized_matmul(x, misaligned, EMPTY, EMPTY, 32, 32, 0, NO_LEVELS, None)


def test_a_linear_layer_reads_its_float32_weight_in_place_where_the_kernel_runs(kernel_variant):
    torch.manual_seed(1)
    layer = Linear(96, 40, bias=False)
    x = torch.randn(7, 96)
    if linear.float_kernel() is None:  # the portable kernels: oneDNN's matmul stays
        assert not layer.can_use_kernel()
        assert pack_linears(layer, layer.weight, 8) and layer.packed is not None and layer.kernel_weight is None
        return
    assert pack_linears(layer, layer.weight, 8) and layer.kernel_weight is not None and layer.packed is None
    out = layer(x)
    assert torch.equal(out, kernel_variant.quantized_matmul(x, *float32_kernel_arguments(layer.weight.detach()), None))
    torch.testing.assert_close(out, F.linear(x, layer.weight.detach()), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x.unsqueeze(0))[0], out)  # any leading axes
    with torch.no_grad():
        layer.weight.mul_(2)  # the kernel reads the parameter itself: no copy to go stale
    assert torch.equal(layer(x), 2 * out)
    rounded = x.bfloat16()  # another dtype: multiplied in float32, rounded back
    assert torch.equal(layer.matmul(x), layer(x)) and torch.equal(layer(rounded), layer(rounded.float()).bfloat16())
    assert layer.row_calls.run(layer.matmul, x[:1]).shape == (1, 40)
    biased = Linear(96, 40, bias=True)
    biased.use_kernel()
    torch.testing.assert_close(
        biased(x), F.linear(x, biased.weight.detach(), biased.bias.detach()), rtol=1e-5, atol=1e-5
    )
    for other in (Linear(48, 8), Linear(96, 8).to(torch.bfloat16)):  # rows not whole groups; not float32
        assert not other.can_use_kernel()
        with pytest.raises(ValueError, match="call pack"):
            other.use_kernel()
    mixed = torch.nn.Sequential(Linear(96, 8), Linear(48, 8))  # each layer takes what it can
    assert pack_linears(mixed, mixed[0].weight, 8)
    assert mixed[0].kernel_weight is not None and mixed[1].packed is not None


def test_the_stack_takes_a_float32_model_and_gives_its_layers_bits(kernel_variant, default_model_dir, monkeypatch):
    from prefixserve import LLM

    if not kernel_variant.has_rowwise or linear.float_kernel() is None:
        pytest.skip(f"the {kernel_variant.variant} kernels leave float32 weights to oneDNN")
    from test_model_decoder_stack import forward, step

    llm = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, log_stats=False)
    model = llm.engine.version.model
    assert all(module.kernel_weight is not None for module in model.modules() if isinstance(module, Linear))
    input_ids, meta, caches = step(model)
    stacked, stacked_caches = forward(model, input_ids, meta, caches, True, monkeypatch)
    assert model._decoder_stack is not None and decoder_stack.build(model) is not None
    layered, layered_caches = forward(model, input_ids, meta, caches, False, monkeypatch)
    assert torch.equal(stacked, layered)
    for (k, v), (k_ref, v_ref) in zip(stacked_caches, layered_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
