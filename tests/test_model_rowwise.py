"""The compiled row-wise kernels (csrc/rowwise.cpp, float32 and bf16) against llama.py's PyTorch ops, in
every variant this CPU runs that has them.

rms_norm, add_rms_norm_, rotate_heads_ and silu_mul each compute a row from that row alone: a row's
bits must be the same alone and in any batch (the engine's batch invariance), and the values must be
the reference's to rounding (a few float32 ulp, one bf16 ulp; rotary and the residual add: bit for
bit by their definition). The model with and
without them must give the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.model.families import llama as llama_module
from prefixserve.model.families.llama import RMSNorm, rotate


@pytest.fixture
def compiled(kernel_variant):
    """Each variant this CPU runs that has the row-wise kernels (every one with a fused multiply-add)."""
    if not kernel_variant.has_rowwise:
        pytest.skip(f"the {kernel_variant.variant} variant has no row-wise kernels (no fused multiply-add)")
    return kernel_variant


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _each_row_alone(function, *row_tensors) -> torch.Tensor:
    rows = range(row_tensors[0].shape[0])
    return torch.cat([function(*(tensor[r : r + 1].clone() for tensor in row_tensors)) for r in rows])


# bf16: two roundings (the normed value, then its product), each may land a bf16 ulp off the reference.
TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2**-6, "atol": 1e-5}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


@DTYPES
@pytest.mark.parametrize("rows, width", [(1, 512), (7, 576), (300, 16), (2020, 512)])
def test_rms_norm_matches_the_reference_and_each_row_is_its_own(rows, width, dtype, monkeypatch, compiled):
    generator = _generator()
    x = (torch.randn(rows, width, generator=generator) * 3).to(dtype)
    norm = RMSNorm(width, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator))
        got = norm(x)
        monkeypatch.setattr(llama_module, "rowwise_for", lambda tensor: None)
        expected = norm(x)  # llama.py's PyTorch ops
    assert torch.equal(got, compiled.rms_norm(x, norm.weight, 1e-5))  # norm(x) took the kernel
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
    assert torch.equal(got, _each_row_alone(lambda row: compiled.rms_norm(row, norm.weight, 1e-5), x))


@DTYPES
@pytest.mark.parametrize("rows", [1, 9, 2020])
def test_add_rms_norm_adds_in_place_and_normalises_the_sum(rows, dtype, compiled):
    generator = _generator()
    x, delta = (
        torch.randn(rows, 512, generator=generator).to(dtype),
        torch.randn(rows, 512, generator=generator).to(dtype),
    )
    weight = torch.randn(512, generator=generator).to(dtype)
    residual = x.clone()
    normed = compiled.add_rms_norm_(residual, delta, weight, 1e-6)
    assert torch.equal(residual, x + delta)  # the residual stream rounds as PyTorch's add
    assert torch.equal(normed, compiled.rms_norm(x + delta, weight, 1e-6))


@DTYPES
@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (33, 3, 128), (2020, 12, 64)])
def test_rotate_heads_is_llama_rotate_bit_for_bit_and_leaves_the_other_columns(rows, heads, head_dim, dtype, compiled):
    generator = _generator()
    columns = heads * head_dim + 2 * head_dim  # the v columns after q and k are not rotated
    qkv = torch.randn(rows, columns, generator=generator).to(dtype)
    angles = torch.randn(rows, head_dim // 2, generator=generator) * 4
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = qkv.clone()
    compiled.rotate_heads_(rotated, heads, head_dim, cos, sin)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    # The definition: x1 cos - x2 sin and x2 cos + x1 sin, a product rounded to the dtype, then one
    # fused multiply-add rounded to float32 and then to the dtype (float64 holds these products exactly).
    x1, x2 = (part.double() for part in qk.chunk(2, dim=-1))
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    first = ((x1 * c).float().to(dtype).double() - x2 * s).float().to(dtype)
    second = ((x2 * c).float().to(dtype).double() + x1 * s).float().to(dtype)
    assert torch.equal(rotated[:, : heads * head_dim].view(rows, heads, head_dim), torch.cat([first, second], dim=-1))
    reference = rotate(qk, cos[:, None, :], sin[:, None, :])
    torch.testing.assert_close(
        rotated[:, : heads * head_dim].view(rows, heads, head_dim).float(),
        reference.float(),
        rtol=0 if dtype == torch.float32 else 2**-7,
        atol=1e-6,
    )
    assert torch.equal(rotated[:, heads * head_dim :], qkv[:, heads * head_dim :])


@DTYPES
@pytest.mark.parametrize("rows, width", [(1, 1344), (5, 16), (2020, 1344)])
def test_silu_mul_matches_the_reference_and_each_row_is_its_own(rows, width, dtype, compiled):
    generator = _generator()
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 6).to(dtype)
    got = compiled.silu_mul(gate_up)
    gate, up = gate_up.split(width, dim=-1)
    tolerance = {"rtol": 2e-6, "atol": 1e-7} if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).float(), **tolerance)
    assert torch.equal(got, _each_row_alone(compiled.silu_mul, gate_up))


def test_silu_mul_at_the_ends_of_float32(compiled):
    gate = torch.tensor([-100.0, 100.0, 0.0, float("inf"), float("-inf"), float("nan"), -88.0, 88.0] + [1.0] * 8)
    got = compiled.silu_mul(torch.cat([gate, torch.ones(16)])[None])[0]
    expected = F.silu(gate)
    assert torch.equal(got.isnan(), expected.isnan())
    torch.testing.assert_close(got[~expected.isnan()], expected[~expected.isnan()], rtol=2e-6, atol=0)


def test_rowwise_kernels_refuse_what_they_cannot_take(compiled):
    x, weight = torch.zeros(2, 32), torch.ones(32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        compiled.rms_norm(torch.zeros(2, 24), torch.ones(24), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        compiled.rms_norm(x.double(), weight.double(), 1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        compiled.rms_norm(x.bfloat16(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="width"):
        compiled.rms_norm(x, torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        compiled.add_rms_norm_(x, torch.zeros(3, 32), weight, 1e-5)
    with pytest.raises(RuntimeError, match="fit"):
        compiled.rotate_heads_(x, 2, 32, torch.zeros(2, 16), torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="overlap"):
        compiled.rotate_heads_(torch.zeros(1, 32).expand(2, 32), 1, 32, torch.zeros(2, 16), torch.zeros(2, 16))
    with pytest.raises(RuntimeError, match="per row"):
        compiled.rotate_heads_(x, 1, 32, torch.zeros(3, 16), torch.zeros(3, 16))
    with pytest.raises(RuntimeError, match="twice"):
        compiled.silu_mul(torch.zeros(2, 48))


def test_the_model_gives_the_same_tokens_with_and_without_the_rowwise_kernels(monkeypatch, compiled):
    """The whole float32 model, fused against llama.py's PyTorch ops (the fallback)."""
    from prefixserve import LLM, SamplingParams

    llm = LLM(dtype="float32", enable_prefix_caching=False, log_stats=False)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 8000 + 10 for j in range(40 + 25 * i)] for i in range(4)]
    fused = [output.token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(llama_module, "rowwise_for", lambda tensor: None)
    plain = [output.token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == plain
