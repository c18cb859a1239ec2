"""The LoRA kernel (csrc/lora.cpp through csrc/lora_slots.cpp, lora/step.py's KernelSlots) on every variant: each
row updated by its own slot's adapter to float32 rounding of the exact update, a row without one left bit for bit,
a row's bits the same alone, in any company and any order; the compiled decoder stack applies adapters as the
layer-by-layer path does, bit for bit; what Python hands in is checked."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import save_adapter

from prefixserve.lora.adapter import FusedUpdate, fuse
from prefixserve.lora.step import KernelSlots, LoRAStep, attach, kernel_layout

IN, WIDTH = 96, 72  # 72 columns: whole vectors and a tail on every variant


def update(seed: int, ranks: tuple[int, ...], scaling: float) -> FusedUpdate:
    """Parts of these ranks side by side over the output columns (the last part reaching the last column)."""
    generator = torch.Generator().manual_seed(seed)
    pieces, column = [], 0
    for index, rank in enumerate(ranks):
        width = WIDTH - column if index == len(ranks) - 1 else 24
        pieces.append(
            (
                torch.randn(rank, IN, generator=generator) / IN**0.5,
                torch.randn(width, rank, generator=generator),
                column,
            )
        )
        column += width
    return fuse(pieces, WIDTH, scaling)


def middle_only(seed: int) -> FusedUpdate:
    """One part over columns 24-47 alone (as k of a qkv adapter that adapts only k)."""
    generator = torch.Generator().manual_seed(seed)
    return fuse([(torch.randn(5, IN, generator=generator), torch.randn(24, 5, generator=generator), 24)], WIDTH, 1.0)


# one part of rank 3; three parts (as q, k, v); two parts (as gate, up), one past rank 16; one part mid-row
UPDATES = [update(1, (3,), 2.0), update(2, (4, 2, 2), 0.5), update(3, (20, 4), 1.25), middle_only(4)]


def slots_for(kernels, updates=UPDATES):
    """A one-layer table whose slot i holds updates[i] as the `o` projection (module 1)."""
    table = kernels.lora_slots(len(updates), 1)
    for slot, one in enumerate(updates):
        table.install(slot, [kernel_layout({"o": one})])
    return table


def reference(x: torch.Tensor, out: torch.Tensor, slot_of_row: list[int]) -> torch.Tensor:
    expected = out.double().clone()
    for row, slot in enumerate(slot_of_row):
        if slot >= 0:
            one = UPDATES[slot]
            expected[row] += (x[row].double() @ one.a.double().t() @ one.b.double().t()) * one.scaling
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_adapters_update_on_every_variant(kernel_variant, dtype):
    table = slots_for(kernel_variant)
    generator = torch.Generator().manual_seed(7)
    slot_of_row = [0, -1, 2, 1, 1, -1, 0, 2, 3, 2]
    x = torch.randn(len(slot_of_row), IN, generator=generator).to(dtype)
    base = torch.randn(len(slot_of_row), WIDTH, generator=generator).to(dtype)
    out = base.clone()
    table.apply(0, 1, x, out, torch.tensor(slot_of_row, dtype=torch.int32))
    expected = reference(x, base, slot_of_row)
    for row, slot in enumerate(slot_of_row):
        if slot < 0:
            assert torch.equal(out[row], base[row])  # the base's rows are never written
        if slot == 3:  # nor the columns no part adapts
            assert torch.equal(out[row, :24], base[row, :24]) and torch.equal(out[row, 48:], base[row, 48:])
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), **tolerance)
    for row, slot in enumerate(slot_of_row):  # alone, and among other rows in another order: the same bits
        alone = base[row : row + 1].clone()
        table.apply(0, 1, x[row : row + 1], alone, torch.tensor([slot], dtype=torch.int32))
        assert torch.equal(alone[0], out[row])
    order = torch.randperm(len(slot_of_row), generator=generator)
    shuffled = base[order].clone()
    table.apply(0, 1, x[order].contiguous(), shuffled, torch.tensor(slot_of_row, dtype=torch.int32)[order])
    assert torch.equal(shuffled, out[order])


def test_bad_calls_are_refused_before_any_kernel_reads(kernel_variant):
    table = slots_for(kernel_variant)
    x, out = torch.randn(2, IN), torch.randn(2, WIDTH)
    with pytest.raises(RuntimeError, match="holds no adapter"):
        table.apply(0, 1, x, out, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="update takes 96 inputs to 72 outputs"):
        table.apply(0, 1, torch.randn(2, IN + 16), out, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one slot per row"):
        table.apply(0, 1, x, out, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one dtype"):
        table.apply(0, 1, x, out.bfloat16(), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="layer or module out of range"):
        table.apply(1, 1, x, out, torch.tensor([0, 1], dtype=torch.int32))
    before = out.clone()
    table.apply(0, 0, x, out, torch.tensor([0, 1], dtype=torch.int32))  # qkv: these slots do not adapt it
    assert torch.equal(out, before)


def test_slots_hold_the_steps_adapters_and_refill_the_least_recently_used():
    installed = []

    class Table:
        def install(self, slot, layers):
            installed.append(slot)

    class Adapter:
        def __init__(self, fingerprint):
            self.fingerprint, self.layers = fingerprint, [{}]

    slots = KernelSlots(Table(), 2)
    a, b, c = Adapter("a"), Adapter("b"), Adapter("c")
    assert slots.slots_of([a, b]) == {"a": 0, "b": 1} and installed == [0, 1]
    assert slots.slots_of([b]) == {"b": 1} and installed == [0, 1]  # held: not installed again
    assert slots.slots_of([c, b]) == {"c": 0, "b": 1} and installed == [0, 1, 0]  # a was used longest ago
    assert slots.slots_of([a, b, c]) is None  # more than the slots: PyTorch's way for that step


def test_the_compiled_stack_applies_adapters_as_the_layers_do(kernel_variant, default_model_dir, tmp_path, monkeypatch):
    """The int4 built-in model (which the stack runs) with two adapters and the base in one step: the stack's
    output and K/V equal the layer-by-layer path's (each projection then the LoRA kernel, from Python)."""
    pytest.importorskip("peft")
    from test_model_decoder_stack import forward, quantized_model, step

    from prefixserve.lora.adapter import load_adapter

    if not kernel_variant.has_rowwise:
        pytest.skip(f"the {kernel_variant.variant} kernels have no row-wise kernels: no compiled stack")
    model = quantized_model("int4", default_model_dir)
    lora = LoRAStep(2, kernel_variant.lora_slots)
    attach(model, lora)
    first = load_adapter("first", save_adapter(tmp_path / "first", 3), model.config, 16)
    second = load_adapter(
        "second", save_adapter(tmp_path / "second", 4, targets=["v_proj", "down_proj"], rank=4), model.config, 16
    )
    input_ids, meta, caches = step(model)  # rows 0-4, 5, 6-8: three sequences
    lora.begin([(first, 0, 5), (None, 5, 6), (second, 6, 9)], 9, None, torch.device("cpu"))
    assert lora.kernel_arguments() != () and model._decoder_stack is not None
    stacked, stacked_caches = forward(model, input_ids, meta, caches, True, monkeypatch)
    layered, layered_caches = forward(model, input_ids, meta, caches, False, monkeypatch)
    assert torch.equal(stacked, layered)
    for (k, v), (k_ref, v_ref) in zip(stacked_caches, layered_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    lora.begin([(None, 0, 9)], 9, None, torch.device("cpu"))
    plain, _ = forward(model, input_ids, meta, caches, True, monkeypatch)
    assert not torch.equal(plain[:5], stacked[:5]) and torch.equal(
        plain[5], stacked[5]
    )  # adapters change their rows only


def test_a_quantized_base_serves_adapters_alike_alone_batched_and_warm(default_model_dir, tmp_path):
    """int4 projections (the compiled stack's path): the adapter's rows are its own whatever the batch, a cache hit
    changes no token, and the base rows of a mixed batch are the base's."""
    pytest.importorskip("peft")
    from prefixserve import LLM, LoRARequest, SamplingParams

    adapter = LoRARequest("q", 1, save_adapter(tmp_path / "q", 6))
    llm = LLM(str(default_model_dir), quantize="int4", enable_lora=True, kv_cache_memory_bytes=8 << 20, log_stats=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = "A harbour at dusk: the boats come in one by one, their lamps lit, the gulls still circling over"
    (alone,) = llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)
    mixed = llm.generate(
        [prompt, prompt, "Another prompt entirely"], params, use_tqdm=False, lora_request=[None, adapter, adapter]
    )
    (base,) = llm.generate([prompt], params, use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids and mixed[1].num_cached_tokens > 0
    assert mixed[0].token_ids == base.token_ids != alone.token_ids
