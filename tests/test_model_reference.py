"""Our paged-attention Llama family against transformers, on CPU in float32.

Nine checkpoints: the built-in default model, a Qwen2-style one (q/k/v bias, tied embeddings,
GQA 6/2, explicit head_dim), a Llama 3.1-style one (llama3 rope scaling, one KV head), and one each of
Qwen3 (per-head q/k norms, head_dim 64), SmolLM3 (a layer without rotary, tied), Phi-3 (fused weights
on disk), Gemma 2 (capped attention scores and logits, head_dim 64) and Gemma 3 (its norms, GeGLU, scaled
embeddings, local and global rope, logit cap), and a Mistral, random
weights in the shapes transformers' own config classes give. The Mistral's, the Gemmas' and one of the Qwen3's
layers slide over windows shorter than the prompts.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import (
    BLOCK_SIZE,
    PagedSequences,
    gemma2_config,
    gemma3_config,
    greedy_paged,
    llama3_config,
    mistral_config,
    phi3_config,
    qwen2_config,
    qwen3_config,
    smollm3_config,
    write_random_checkpoint,
)

from prefixserve.model import Tokenizer, load_model

transformers = pytest.importorskip("transformers")

PROMPT = (
    "The paged cache keeps every block of sixteen tokens apart, and a sequence's blocks "
    "need not be adjacent: here they are scattered on purpose."
)
# Non-contiguous, out-of-order block ids: a bug that assumes adjacency shows up as wrong logits.
TABLE = [11, 3, 7, 0, 9, 14, 5]
MODEL_KINDS = ["default", "qwen2", "llama3", "qwen3", "smollm3", "phi3", "gemma2", "gemma3", "mistral"]


@pytest.fixture(scope="module")
def checkpoints(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference-checkpoints")
    return {
        "default": default_model_dir,
        "qwen2": write_random_checkpoint(root / "qwen2", qwen2_config(), seed=1),
        "llama3": write_random_checkpoint(root / "llama3", llama3_config(), seed=2),
        "qwen3": write_random_checkpoint(root / "qwen3", qwen3_config(), seed=3),
        "smollm3": write_random_checkpoint(root / "smollm3", smollm3_config(), seed=4),
        "phi3": write_random_checkpoint(root / "phi3", phi3_config(), seed=5),
        "gemma2": write_random_checkpoint(root / "gemma2", gemma2_config(), seed=8),
        "gemma3": write_random_checkpoint(root / "gemma3", gemma3_config(), seed=6),
        "mistral": write_random_checkpoint(root / "mistral", mistral_config(), seed=7),
    }


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir):
    ids = Tokenizer.from_dir(default_model_dir).encode(PROMPT)
    assert 30 <= len(ids) <= 60 and len(ids) > 2 * BLOCK_SIZE  # spans at least three blocks
    return ids


@pytest.fixture(scope="module")
def ours(checkpoints):
    return {kind: load_model(path, torch.float32, torch.device("cpu")).model for kind, path in checkpoints.items()}


@pytest.fixture(scope="module")
def reference(checkpoints):
    return {
        kind: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for kind, path in checkpoints.items()
    }


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_prefill_logits_match_transformers(kind, ours, reference, prompt_ids):
    logits = PagedSequences(ours[kind]).step([prompt_ids], [0], [TABLE])
    with torch.inference_mode():
        expected = reference[kind](torch.tensor([prompt_ids])).logits[0].float()
    assert logits.shape == expected.shape
    assert expected.std() > 1.0  # well-separated logits, or the comparison below means little
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_greedy_decode_matches_transformers_generate(kind, ours, reference, prompt_ids):
    num_tokens = 20
    tokens = greedy_paged(ours[kind], prompt_ids, num_tokens, TABLE)
    with torch.inference_mode():
        generated = reference[kind].generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    assert tokens == generated[0, len(prompt_ids) :].tolist()
    assert len(set(tokens)) > 5  # a model stuck on one token would make this test vacuous


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_chunked_prefill_equals_single_chunk(kind, ours, prompt_ids):
    whole = PagedSequences(ours[kind]).step([prompt_ids], [0], [TABLE])
    runner = PagedSequences(ours[kind])
    split = 21  # not a block boundary: the second chunk starts mid-block
    first = runner.step([prompt_ids[:split]], [0], [TABLE])
    second = runner.step([prompt_ids[split:]], [split], [TABLE])
    # Not bit-equal: other GEMM shapes and a masked (not is_causal) SDPA round differently.
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_separate_steps(ours, prompt_ids):
    """One step holding a prefill continuation (A) and two decodes (B, C) gives each sequence the
    logits it gets when run alone."""
    model = ours["default"]
    tables = {"A": [4, 9, 1, 12], "B": [7, 2, 15], "C": [0, 13, 6, 3]}
    prompts = {"A": prompt_ids, "B": prompt_ids[5:30], "C": prompt_ids[::-1][:40]}
    cached = {"A": 20, "B": len(prompts["B"]) - 1, "C": len(prompts["C"]) - 1}

    def run_alone(name):
        runner = PagedSequences(model)
        runner.step([prompts[name][: cached[name]]], [0], [tables[name]])
        return runner.step([prompts[name][cached[name] :]], [cached[name]], [tables[name]])

    alone = {name: run_alone(name) for name in tables}

    runner = PagedSequences(model)  # one shared pool: the tables above are disjoint
    for name in tables:
        runner.step([prompts[name][: cached[name]]], [0], [tables[name]])
    order = ["B", "A", "C"]  # a decode before and after the prefill chunk
    batched = runner.step(
        [prompts[name][cached[name] :] for name in order],
        [cached[name] for name in order],
        [tables[name] for name in order],
    )
    rows = torch.split(batched, [len(prompts[name]) - cached[name] for name in order])
    for name, logits in zip(order, rows):
        torch.testing.assert_close(logits, alone[name], atol=1e-4, rtol=1e-4)


def test_bfloat16_tracks_float32(default_model_dir, ours, prompt_ids):
    """bf16 rounding differs between kernels and CPUs, but it must stay close to float32."""
    model = load_model(default_model_dir, torch.bfloat16, torch.device("cpu")).model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    logits = PagedSequences(model).step([prompt_ids], [0], [TABLE])
    exact = PagedSequences(ours["default"]).step([prompt_ids], [0], [TABLE])
    assert logits.dtype == torch.float32
    agreement = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agreement > 0.8
    assert (logits - exact).abs().mean() < 0.1 * exact.std()


def test_default_model_logits_are_well_separated(ours, prompt_ids):
    """Greedy tokens must not hinge on float noise: top-1 beats top-2 by far more than 1e-3."""
    logits = PagedSequences(ours["default"]).step([prompt_ids], [0], [TABLE])
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).sort().values
    assert gaps[len(gaps) // 2] > 0.1  # typical gap
    assert gaps[0] > 1e-3  # even the closest call in this prompt
