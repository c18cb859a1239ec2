"""row_calls.py: which row counts a matmul is called with, so that a row's result never depends on its
batch. The probe must catch a library that rounds some call size differently, even rarely, and a call
of any row count must be served by accepted sizes alone."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model import linear as linear_module
from prefixserve.model import row_calls
from prefixserve.model.row_calls import Call, RowCalls, candidate_sizes, probe


def test_candidate_sizes_cover_every_decode_batch_and_grow_to_the_step_budget():
    sizes = candidate_sizes(2048)
    assert sizes[:32] == list(range(1, 33))
    assert sizes[32:] == [48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert candidate_sizes(5) == [1, 2, 3, 4, 5, 16]  # the reference size is always there


def test_a_call_is_made_only_of_accepted_sizes_padded_a_little_or_split():
    plan = RowCalls((2, 3, 16, 33, 1536, 2048))
    assert plan.plan(16) == (Call(16, 16),)
    assert plan.plan(1) == (Call(1, 2),)  # a lone row padded to the smallest accepted size
    assert plan.plan(2020) == (Call(2020, 2048),)  # 28 rows of padding: one call
    assert plan.plan(100) == (Call(33, 33), Call(33, 33), Call(33, 33), Call(1, 2))
    assert plan.plan(0) == (Call(0, 0),)
    assert RowCalls.ALL.plan(77) == (Call(77, 77),)
    for rows in range(1, 3000, 37):
        calls = plan.plan(rows)
        assert sum(call.rows for call in calls) == rows
        assert all(call.size in plan.accepted and call.rows <= call.size for call in calls)


def test_run_computes_every_row_as_the_plain_matmul_does():
    # Small integers: every sum exact, so any row count gives the same results and the check is the plan's.
    weight = torch.randint(-8, 8, (40, 24), generator=torch.Generator().manual_seed(2)).double()
    x = torch.randint(-8, 8, (101, 24), generator=torch.Generator().manual_seed(3)).double()
    sizes_called = []

    def matmul(rows):
        sizes_called.append(rows.shape[0])
        return rows @ weight.T

    out = RowCalls((2, 16, 48)).run(matmul, x)
    assert set(sizes_called) <= {2, 16, 48}
    assert torch.equal(out, matmul(x))


def _rounding_differently_at(size: int, every: int):
    """A matmul returning bf16 (its own rounding) whose calls of `size` rows add one float32 ulp to one
    output in one of `every` calls: a rare difference, as oneDNN's below AVX-512 BF16."""
    weight = torch.randn(512, 64, generator=torch.Generator().manual_seed(4))
    calls = {"n": 0}

    def matmul(x):
        sums = (x.double() @ weight.double().T).float()  # float64 sums: alike at any row count
        if x.shape[0] == size:
            calls["n"] += 1
            if calls["n"] % every == 0:
                sums[0, 0] = torch.nextafter(sums[0, 0], torch.tensor(float("inf")))
                sums[0, 0] = sums[0, 0] + sums[0, 0].abs() * 2**-8  # past the bf16 rounding boundary
        return sums.bfloat16()

    return matmul


def test_the_probe_catches_a_size_that_rounds_differently_only_now_and_then():
    accepted = probe(_rounding_differently_at(3, every=40), 64, 512, torch.bfloat16, torch.device("cpu"), 64)
    assert 3 not in accepted.accepted
    assert {1, 2, 4, 16, 32} <= set(accepted.accepted)


def test_a_float32_result_is_probed_in_one_call_of_each_size(monkeypatch):
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    calls = []

    def matmul(x):
        calls.append(x.shape[0])
        out = (x.double() @ weight.double().T).float()
        if x.shape[0] == 5:
            out = out + 1e-6  # another order would change most outputs; this changes all
        return out

    accepted = probe(matmul, 16, 32, torch.float32, torch.device("cpu"), 32).accepted
    assert 5 not in accepted and 6 in accepted
    assert calls.count(7) == 1  # one call of 7 rows sufficed


def test_bf16_multiplied_in_float32_is_probed_before_its_rounding(monkeypatch):
    """Where the CPU has no bf16 matmul, linear.py rounds float32 sums to bf16 itself: the probe reads
    the sums, where another order shows in most outputs."""
    monkeypatch.setattr(linear_module, "native_bfloat16_matmul", lambda: False)
    layer = linear_module.Linear(64, 96, bias=False).to(torch.bfloat16)
    layer.pack(64)
    assert layer.emulated
    seen = []
    real = row_calls.probe

    def spy(matmul, *args):
        seen.append(matmul(torch.zeros(1, 64, dtype=torch.bfloat16)).dtype)
        return real(matmul, *args)

    monkeypatch.setattr(row_calls, "probe", spy)
    row_calls._probed.clear()
    layer.plan_rows(True, 64)
    assert seen == [torch.float32]
    assert layer(torch.randn(3, 64).to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_linear_of_the_model_is_invariant_through_its_plan(default_model_dir, dtype):
    """The built-in model's layers, set up as the engine sets them up: a row's result is the same at any
    row count, checked against 16-row calls for counts 1..80."""
    from prefixserve.model import load_model
    from prefixserve.model.linear import Linear

    model = load_model(default_model_dir, dtype, torch.device("cpu")).model
    model.pack_linear_weights(batch_size_hint=2048)
    model.plan_rows(batch_invariant=True, max_rows=128, max_sampled_rows=16)
    generator = torch.Generator().manual_seed(6)
    shapes = {}
    for module in model.modules():
        if isinstance(module, Linear):
            shapes.setdefault((module.in_features, module.out_features), module)
    with torch.inference_mode():
        for module in shapes.values():
            x = torch.randn(96, module.in_features, generator=generator).to(dtype)
            reference = torch.cat([module.matmul(x[i : i + 16]) for i in range(0, 96, 16)])
            for rows in range(1, 81):
                assert torch.equal(module(x[:rows]), reference[:rows]), (module.in_features, module.out_features, rows)
