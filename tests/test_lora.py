"""LoRA adapters on the base model (prefixserve/lora/): the same greedy tokens as transformers + peft on the same
base and adapter, in batches mixing the base and several adapters, cold and warm, float32 and bfloat16; a cache
scoped by the adapter's weights, not its name; bad adapters refused at load, naming the cause."""

import json

import pytest
import torch
from model_helpers import reference_greedy

from prefixserve import LLM, LoRARequest, SamplingParams
from prefixserve.lora.adapter import AdapterError
from prefixserve.model import ensure_default_model

pytest.importorskip("peft")

PROMPTS = [  # each longer than two blocks of 16 tokens, so that a second run hits
    "The quick brown fox jumps over the lazy dog, and then the dog chases the fox across the field until",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef",
    "In 1905, Albert Einstein published four papers that changed physics: on light quanta, on Brownian",
]
NUM_TOKENS = 16
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(directory, seed, targets=ALL_TARGETS, rank=8, alpha=16, rslora=False, scale=1.0):
    """A random PEFT adapter of the built-in model, as peft's save_pretrained writes it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(scale)
    model.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": save_adapter(root / "alpha", 1),
        "beta": save_adapter(root / "beta", 2, targets=["q_proj", "v_proj", "down_proj"], rank=4, rslora=True),
    }


def peft_greedy(adapter_path, prompt_ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=dtype).eval()
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path).eval()
    return reference_greedy(model, prompt_ids, NUM_TOKENS)


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
        "missing directory": (LoRARequest("gone", 3, str(tmp_path / "nowhere")), "is not a directory"),
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
