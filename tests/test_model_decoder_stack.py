"""The compiled decoder stack (model/families/decoder_stack.py, csrc/decoder_stack.cpp): every layer of a step in one
call gives the bits of llama.py's layer-by-layer path, on every variant, prefill rows and decodes alike; it
runs only where those layers would take exactly its kernels; what Python hands it is checked."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import Q, gguf_tensors, random_hf_weights, tiny_llama_config, train_tokenizer, write_gguf

from prefixserve import LLM, SamplingParams
from prefixserve.model import kernels
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.families import decoder_stack

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """Head_dim 32 (the stack's rotary), fused projections whose parts come in three layouts: q Q4_1, k Q4_0,
    v Q8_0, gate Q4_1, up Q8_0 (one weight per layout, side by side), the rest Q4_0 (no offsets)."""
    tokenizer = train_tokenizer()
    config = dict(tiny_llama_config(vocab_size=len(tokenizer[0])), hidden_size=128, head_dim=32, intermediate_size=256)
    stored = gguf_tensors(config, random_hf_weights(config, seed=5))
    layouts = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0}
    kinds = {
        name: next((kind for part, kind in layouts.items() if f".{part}." in name), Q.Q4_0)
        for name, value in stored.items()
        if value.ndim == 2
    }
    return write_gguf(tmp_path_factory.mktemp("stack") / "mixed.gguf", config, stored, kinds, tokenizer=tokenizer)


def quantized_model(source, default_model_dir):
    """The built-in model at int4 (Q4_1 projections), or a GGUF's own blocks, as an engine serves it."""
    if source == "int4":
        llm = LLM(str(default_model_dir), quantize="int4", kv_cache_memory_bytes=4 << 20, log_stats=False)
    else:
        llm = LLM(str(source), kv_cache_memory_bytes=4 << 20, log_stats=False)
    return llm.engine.version.model


def step(model, seed: int = 0):
    """A step of three sequences (a whole 5-token prompt, a decode at position 19, a 3-token chunk after 9
    cached tokens) over caches holding random earlier K/V; every row sampled, as a decode step is."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    shape = (12, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(config.num_hidden_layers)
    ]
    meta = AttentionMetadata.build([5, 1, 3], [5, 20, 12], [[3], [7, 1], [10]], BLOCK_SIZE)
    input_ids = torch.randint(0, config.vocab_size, (9,), generator=generator)
    return input_ids, meta, caches


def forward(model, input_ids, meta, caches, stacked: bool, monkeypatch):
    monkeypatch.setattr(decoder_stack, "ENABLED", stacked)
    caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        hidden = model(input_ids, meta.positions, caches, meta)
    return hidden, caches


@pytest.mark.parametrize("source", ["int4", "gguf"])
def test_the_stack_gives_the_layers_bits_on_every_variant(
    kernel_variant, source, default_model_dir, mixed_gguf, monkeypatch
):
    if not kernel_variant.has_rowwise:
        pytest.skip(f"the {kernel_variant.variant} kernels have no row-wise kernels: llama.py's path runs alone")
    model = quantized_model("int4" if source == "int4" else mixed_gguf, default_model_dir)
    input_ids, meta, caches = step(model)
    stacked, stacked_caches = forward(model, input_ids, meta, caches, True, monkeypatch)
    assert model._decoder_stack is not None and model._decoder_stack.num_layers == model.config.num_hidden_layers
    layered, layered_caches = forward(model, input_ids, meta, caches, False, monkeypatch)
    assert torch.equal(stacked, layered)
    for (k, v), (k_ref, v_ref) in zip(stacked_caches, layered_caches):  # the same K/V written to the same slots
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    if source == "gguf":  # the fused projections really are several weights side by side
        assert len(model.layers[0].self_attn.qkv_proj.parts) == 3 and len(model.layers[0].mlp.gate_up_proj.parts) == 2


def test_an_engine_serves_through_the_stack_and_nothing_changes(default_model_dir, monkeypatch):
    if kernels.compiled is None or not kernels.compiled.has_rowwise:
        pytest.skip("no compiled row-wise kernels on this machine")
    prompts = ["The capital of France is", "Hello world! Hello there", "def main():\n    return"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

    def run(stacked: bool):
        monkeypatch.setattr(decoder_stack, "ENABLED", stacked)
        llm = LLM(str(default_model_dir), quantize="int4", kv_cache_memory_bytes=16 << 20, log_stats=False)
        outputs = llm.generate(prompts, params)
        return llm, [(list(output.token_ids), repr(output.logprobs)) for output in outputs]

    llm, stacked = run(True)
    assert llm.engine.version.model._decoder_stack is not None
    assert run(False)[1] == stacked  # tokens and logprobs, to the bit


def test_the_stack_runs_only_where_the_layers_take_its_kernels(default_model, default_model_dir, tmp_path):
    assert decoder_stack.build(default_model.model) is None  # float weights not handed to our kernel (unpacked)
    tokenizer = train_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))  # head_dim 16: rotary stays in PyTorch
    stored = gguf_tensors(config, random_hf_weights(config, seed=6))
    path = write_gguf(
        tmp_path / "narrow.gguf",
        config,
        stored,
        {name: Q.Q8_0 for name, value in stored.items() if value.ndim == 2},
        tokenizer=tokenizer,
    )
    assert decoder_stack.build(quantized_model(path, default_model_dir)) is None
    qwen3 = tiny_llama_config(vocab_size=len(tokenizer[0]), model_type="qwen3")  # per-head q/k norms
    qwen3.update(hidden_size=128, head_dim=32, intermediate_size=256)
    stored = gguf_tensors(qwen3, random_hf_weights(qwen3, seed=7))
    path = write_gguf(
        tmp_path / "qwen3.gguf",
        qwen3,
        stored,
        {name: Q.Q8_0 for name, value in stored.items() if value.ndim == 2},
        tokenizer=tokenizer,
    )
    assert decoder_stack.build(quantized_model(path, default_model_dir)) is None


def test_what_python_hands_the_stack_is_checked(default_model_dir):
    if kernels.compiled is None or not kernels.compiled.has_rowwise:
        pytest.skip("no compiled row-wise kernels on this machine")
    model = quantized_model("int4", default_model_dir)
    stack = decoder_stack.build(model)
    input_ids, meta, caches = step(model)
    x = model.embed(input_ids)
    rotary = model.rotary(meta.positions, x.dtype)

    def run(meta=meta, caches=caches, x=x):
        decoder_stack.run(stack, x.clone(), rotary, caches, meta)

    run()  # as built, it runs
    bad_slot = AttentionMetadata.build([5, 1, 3], [5, 20, 12], [[3], [7, 1], [10]], BLOCK_SIZE)
    bad_slot.slot_mapping = bad_slot.slot_mapping.clone()
    bad_slot.slot_mapping[4] = 12 * BLOCK_SIZE  # one past the cache
    with pytest.raises(RuntimeError, match="slot out of range"):
        run(meta=bad_slot)
    with pytest.raises(RuntimeError, match="block id out of range"):
        run(meta=AttentionMetadata.build([5, 1, 3], [5, 20, 12], [[3], [7, 12], [10]], BLOCK_SIZE))
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        run(caches=caches[:-1])
    with pytest.raises(RuntimeError, match="every cache must be"):
        run(caches=[(k.to(torch.bfloat16), v) for k, v in caches])
    with pytest.raises(RuntimeError, match="x must be"):
        run(x=x[:, :-16])
