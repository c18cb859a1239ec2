"""LoRA adapters on the base model (prefixserve/lora/): the same greedy tokens as transformers + peft on the same
base and adapter, in batches mixing the base and several adapters, cold and warm, float32 and bfloat16; a cache
scoped by the adapter's weights, not its name; bad adapters refused at load, naming the cause."""

import json

import lora_helpers
import pytest
import torch
from lora_helpers import save_adapter

from prefixserve import LLM, LoRARequest, SamplingParams
from prefixserve.lora.adapter import AdapterError

pytest.importorskip("peft")

PROMPTS = [  # each longer than two blocks of 16 tokens, so that a second run hits
    "The quick brown fox jumps over the lazy dog, and then the dog chases the fox across the field until",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef",
    "In 1905, Albert Einstein published four papers that changed physics: on light quanta, on Brownian",
]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": save_adapter(root / "alpha", 1),
        "beta": save_adapter(root / "beta", 2, targets=["q_proj", "v_proj", "down_proj"], rank=4, rslora=True),
    }


def peft_greedy(adapter_path, prompt_ids, dtype=torch.float32):
    return lora_helpers.peft_greedy(adapter_path, prompt_ids, NUM_TOKENS, dtype)


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_lora=True, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)


def greedy():
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def test_a_batch_of_the_base_and_two_adapters_matches_peft_cold_and_warm(llm, adapters):
    requests = {
        None: None,
        "alpha": LoRARequest("alpha", 1, adapters["alpha"]),
        "beta": LoRARequest("beta", 2, adapters["beta"]),
    }
    names = [None, "alpha", "beta"] * len(PROMPTS)
    prompts = [prompt for prompt in PROMPTS for _ in range(3)]
    cold = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[requests[n] for n in names])
    ids = {out.prompt: out.prompt_token_ids for out in cold}
    expected = {
        name: dict(zip(PROMPTS, peft_greedy(adapters.get(name), [ids[p] for p in PROMPTS]))) for name in requests
    }
    for out, name in zip(cold, names):
        assert out.token_ids == expected[name][out.prompt], (name, out.prompt)
    assert expected["alpha"] != expected[None] and expected["beta"] != expected["alpha"]  # the adapters matter
    warm = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=[requests[n] for n in names])
    assert [out.token_ids for out in warm] == [out.token_ids for out in cold]
    assert all(out.num_cached_tokens > 0 for out in warm)  # each hit its own adapter's blocks


def test_pytorchs_way_matches_peft_where_no_kernel_runs(adapters, monkeypatch):
    """Without the LoRA kernel (no compiled build, or a GPU): each adapter's rows gathered into one float64 batched
    matmul pair; the same tokens as peft, a row's tokens the same alone as in the mixed batch."""
    from prefixserve.engine import runner

    monkeypatch.setattr(runner, "lora_slots_for", lambda device: None)
    llm = LLM(enable_lora=True, dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    assert llm.engine.runner.lora_step.slots is None
    requests = [None, LoRARequest("alpha", 1, adapters["alpha"]), LoRARequest("beta", 2, adapters["beta"])]
    batch = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    for out, request in zip(batch, requests):
        (expected,) = peft_greedy(request.path if request else None, [out.prompt_token_ids])
        assert out.token_ids == expected
    alone = llm.generate([PROMPTS[1]], greedy(), use_tqdm=False, lora_request=requests[2])[0]
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], greedy(), use_tqdm=False, lora_request=[requests[1], requests[2]])
    assert mixed[1].token_ids == alone.token_ids


def test_the_cache_is_scoped_by_the_adapters_weights_not_its_name(llm, adapters, tmp_path):
    prompt = "A shared system prompt for the scope test, long enough to fill several blocks of sixteen tokens."
    alpha = LoRARequest("alpha", 1, adapters["alpha"])
    llm.generate([prompt], greedy(), use_tqdm=False, lora_request=alpha)
    (base,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert base.num_cached_tokens == 0  # the base never reads an adapter's blocks
    (beta,) = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=LoRARequest("beta", 2, adapters["beta"]))
    assert beta.num_cached_tokens == 0  # nor one adapter another's
    (renamed,) = llm.generate(
        [prompt], greedy(), use_tqdm=False, lora_request=LoRARequest("alpha-again", 7, adapters["alpha"])
    )
    assert renamed.num_cached_tokens > 0  # the same weights under another name share blocks
    reloaded = save_adapter(tmp_path / "alpha-new", 5)
    (fresh,) = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=LoRARequest("alpha", 1, reloaded))
    assert fresh.num_cached_tokens == 0  # a name loaded with new weights reads none of the old blocks


def test_bfloat16_cache_on_equals_off_batched_or_alone(adapters):
    """bf16 is held to what the base is held to in bf16 (its greedy tokens drift from transformers' in bf16 on this
    random model): the cache never changes an output, nor does a batch's company."""
    alpha = LoRARequest("alpha", 1, adapters["alpha"])
    runs = {}
    for caching in (True, False):
        llm = LLM(enable_lora=True, dtype="bfloat16", enable_prefix_caching=caching, kv_cache_memory_bytes=16 << 20)
        batched = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=[alpha, None, alpha])
        warm = [llm.generate([prompt], greedy(), use_tqdm=False, lora_request=alpha)[0] for prompt in PROMPTS]
        runs[caching] = ([out.token_ids for out in batched], [out.token_ids for out in warm])
        base = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert runs[True] == runs[False]
    assert runs[True][0][0] == runs[True][1][0] and runs[True][0][2] == runs[True][1][2]  # alone = in a batch
    assert runs[True][0][1] == base[1].token_ids  # the base row of the mixed batch is the base's
    assert runs[True][1][1] != base[1].token_ids  # and the adapter changes what it writes


def test_bad_adapters_are_refused_naming_the_cause_and_the_engine_keeps_serving(llm, adapters, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    def broken(name, edit_tensors=None, edit_config=None, drop=None):
        directory = tmp_path / name
        shutil.copytree(adapters["alpha"], directory)
        if drop:
            (directory / drop).unlink()
        if edit_tensors:
            path = directory / "adapter_model.safetensors"
            save_file(edit_tensors(load_file(str(path))), str(path))
        if edit_config:
            path = directory / "adapter_config.json"
            path.write_text(json.dumps(edit_config(json.loads(path.read_text()))))
        return LoRARequest(name, 9, str(directory))

    def first(tensors, change):
        key = sorted(tensors)[0]
        return {**tensors, key: change(tensors[key])}

    cases = {
        "missing directory": (LoRARequest("gone", 3, str(tmp_path / "nowhere")), "is neither a directory"),
        "missing weights": (
            broken("noweights", drop="adapter_model.safetensors"),
            "adapter_model.safetensors is missing",
        ),
        "missing config": (broken("noconfig", drop="adapter_config.json"), "adapter_config.json is missing"),
        "NaN": (broken("nan", lambda t: first(t, lambda x: x * float("nan"))), "NaN or infinity"),
        "wrong shape": (broken("shape", lambda t: first(t, lambda x: x[:, :-1].contiguous())), "another base model"),
        "unknown target": (
            broken("lm", lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)}),
            "must be among",
        ),
        "DoRA": (broken("dora", edit_config=lambda c: {**c, "use_dora": True}), "DoRA"),
    }
    for case, (request, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            llm.generate(["hello"], greedy(), use_tqdm=False, lora_request=request)
        assert case
    high = save_adapter(tmp_path / "rank32", 3, rank=32)
    with pytest.raises(AdapterError, match="exceeds max_lora_rank=16"):
        llm.generate(["hello"], greedy(), use_tqdm=False, lora_request=LoRARequest("rank32", 4, high))
    (still,) = llm.generate(
        ["hello"], greedy(), use_tqdm=False, lora_request=LoRARequest("alpha", 1, adapters["alpha"])
    )
    assert len(still.token_ids) == NUM_TOKENS


def test_a_lora_request_needs_enable_lora():
    llm = LLM(dtype="float32", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_kv_events_name_the_adapter_that_computed_a_block(adapters):
    from prefixserve.cache.events import BlockStored, event_to_dict
    from prefixserve.engine.kv_event_wire import WireTranslator

    llm = LLM(enable_lora=True, enable_kv_events=True, dtype="float32", kv_cache_memory_bytes=8 << 20)
    llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("alpha", 3, adapters["alpha"]))
    llm.generate([PROMPTS[1]], greedy(), use_tqdm=False)
    stored = [event for event in llm.engine.cache.events.drain() if isinstance(event, BlockStored)]
    labels = {(event.lora_id, event.lora_name) for event in stored}
    assert labels == {(3, "alpha"), (None, None)}
    adapted = next(event for event in stored if event.lora_name == "alpha")
    assert event_to_dict(adapted)["lora_name"] == "alpha"
    assert "lora_name" not in event_to_dict(next(event for event in stored if event.lora_name is None))
    wire = WireTranslator().event(adapted)
    assert (wire.lora_id, wire.lora_name) == (3, "alpha")  # vLLM's BlockStored fields, as its decoder reads them
