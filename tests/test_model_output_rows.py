"""The last layer computes only the rows whose outputs are used (LlamaForCausalLM.forward's
output_rows, the engine's sampled rows): those rows must come out as in the whole step, and every
row's K/V must still reach the cache."""

from __future__ import annotations

import pytest
import torch
from model_helpers import PagedSequences

from prefixserve.model import kernels, load_model
from prefixserve.model.attention import paged as attention_module
from prefixserve.model.attention.metadata import AttentionMetadata, OutputRows

TABLES = {"A": [4, 9, 1, 12], "B": [7, 2, 15], "C": [0, 13, 6, 3]}


def _prompts() -> dict[str, list[int]]:
    base = [(37 * i) % 8000 + 10 for i in range(60)]
    return {"A": base[:55], "B": base[5:30], "C": base[::-1][:40]}


CACHED = {"A": 20, "B": 24, "C": 39}  # A continues a prefill; B and C decode
ORDER = ["B", "A", "C"]


def _primed(model) -> PagedSequences:
    runner = PagedSequences(model)
    prompts = _prompts()
    for name in ORDER:
        runner.step([prompts[name][: CACHED[name]]], [0], [TABLES[name]])
    return runner


def _mixed_step(runner: PagedSequences, output_rows=None) -> torch.Tensor:
    prompts = _prompts()
    return runner.step(
        [prompts[name][CACHED[name] :] for name in ORDER],
        [CACHED[name] for name in ORDER],
        [TABLES[name] for name in ORDER],
        output_rows=output_rows,
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, default_model_dir):
    """Set up as the engine sets it up: packed weights, row calls measured for batch invariance."""
    model = load_model(default_model_dir, getattr(torch, request.param), torch.device("cpu")).model
    model.pack_linear_weights(batch_size_hint=64)
    model.plan_rows(batch_invariant=True, max_rows=128, max_sampled_rows=8)
    return model


@pytest.mark.parametrize("path", ["compiled", "pure-pytorch"])
def test_output_rows_are_those_rows_of_the_whole_step(model, path, monkeypatch):
    if path == "compiled" and kernels.compiled is None:
        pytest.skip("prefixserve's compiled kernels are not built")
    if path == "pure-pytorch":
        monkeypatch.setattr(attention_module, "causal_kernel_for", lambda k_cache: None)
    whole = _mixed_step(_primed(model))
    a_rows = len(_prompts()["A"]) - CACHED["A"]  # rows 1 .. a_rows; B's decode is row 0, C's the last
    rows = [0, 3, a_rows, 1, a_rows + 1]  # B's decode, rows inside A's chunk and its last, C's decode; any order
    assert whole.shape[0] == a_rows + 2
    kept = _mixed_step(_primed(model), output_rows=rows)
    assert kept.shape == (len(rows), whole.shape[1])
    if path == "compiled":
        # batch invariance: a row's attention is its own, its matmuls round alike in any batch
        assert torch.equal(kept, whole[rows])
    else:  # the pure-PyTorch float32 attention may round by the rows it reads together
        torch.testing.assert_close(kept, whole[rows], atol=1e-4, rtol=1e-4)
    assert kept.argmax(-1).tolist() == whole[rows].argmax(-1).tolist()


def test_a_step_without_output_rows_still_writes_every_layers_kv(model):
    """A mid-prompt chunk samples nothing: the last layer only writes its K/V, and the next step's
    logits are those after a full step."""
    prompts = _prompts()
    full, pruned = PagedSequences(model), PagedSequences(model)
    full.step([prompts["A"][:30]], [0], [TABLES["A"]])
    assert pruned.step([prompts["A"][:30]], [0], [TABLES["A"]], output_rows=[]).shape == (0, model.config.vocab_size)
    for (k_full, v_full), (k_pruned, v_pruned) in zip(full.kv_caches, pruned.kv_caches):
        assert torch.equal(k_full, k_pruned) and torch.equal(v_full, v_pruned)
    after_full = full.step([prompts["A"][30:]], [30], [TABLES["A"]])
    after_pruned = pruned.step([prompts["A"][30:]], [30], [TABLES["A"]])
    assert torch.equal(after_full, after_pruned)


def test_output_rows_must_be_rows_of_the_step():
    meta = AttentionMetadata.build([3, 1], [10, 5], [[0], [1]], 16)
    assert OutputRows.of(meta, [2, 3], 16).meta.seq_lens_list == [10, 5]  # A's last row, B's decode
    assert OutputRows.of(meta, [0], 16).meta.seq_lens_list == [8]  # row 0 sits at position 7
    with pytest.raises(ValueError, match="not a row of this step"):
        OutputRows.of(meta, [4], 16)
    with pytest.raises(ValueError, match="not a row of this step"):
        OutputRows.of(meta, [-1], 16)
