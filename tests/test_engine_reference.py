"""Greedy tokens through LLM.generate equal transformers' greedy generate, token for token."""

import pytest
import torch
from conftest import make_llm
from model_helpers import reference_greedy, write_qwen2_checkpoint

from prefixserve import SamplingParams
from prefixserve.model import ensure_default_model

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    return",
    "In 1905, Albert Einstein published four papers that",
]
NUM_TOKENS = 24


def transformers_greedy(model_dir, prompt_ids, num_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return reference_greedy(model, prompt_ids, num_tokens)


def check_against_transformers(model_dir, llm):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    ours = llm.generate(PROMPTS, params, use_tqdm=False)
    reference = transformers_greedy(model_dir, [out.prompt_token_ids for out in ours], NUM_TOKENS)
    for out, expected in zip(ours, reference):
        assert out.token_ids == expected
        assert len(out.token_ids) == NUM_TOKENS and out.finish_reason == "length"


def test_default_model_matches_transformers():
    model_dir = ensure_default_model()
    check_against_transformers(model_dir, make_llm())


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return write_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2"), seed=3)


def test_qwen2_style_checkpoint_matches_transformers(qwen2_dir):
    llm = make_llm(model=str(qwen2_dir), max_num_batched_tokens=32)  # chunked prefill on the way
    check_against_transformers(qwen2_dir, llm)
