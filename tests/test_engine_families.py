"""Each family beyond Llama through the whole engine (issue 27): Qwen3, SmolLM3, Phi-3, Gemma 2 and Gemma 3
checkpoints give transformers' greedy tokens through LLM.generate, cold (chunked prefill), warm (every full block a
cache hit) and batched, in float32, on the compiled kernels and the pure-PyTorch path (the Gemmas' and a Qwen3
layer's sliding windows are shorter than the prompts); in bfloat16 a cache hit changes no token; `serve --model`
answers alike."""

import httpx
import pytest
from conftest import make_llm
from model_helpers import (
    gemma2_config,
    gemma3_config,
    phi3_config,
    phi3_longrope_config,
    phi4_mini_config,
    qwen3_config,
    smollm3_config,
    write_servable_checkpoint,
)
from server_helpers import LiveServer
from test_engine_reference import NUM_TOKENS, PROMPTS, transformers_greedy

from prefixserve import SamplingParams

FAMILIES = {
    "qwen3": qwen3_config,
    "smollm3": smollm3_config,
    "phi3": phi3_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
    "phi3_longrope": phi3_longrope_config,
    "phi4_mini": phi4_mini_config,
}
LONG_PROMPT = "A cached prefix of several blocks, read back on the second request: " * 3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return write_servable_checkpoint(tmp_path_factory.mktemp(request.param), FAMILIES[request.param](), seed=7)


def test_cold_warm_and_batched_tokens_equal_transformers(family_dir, attention_path):
    llm = make_llm(model=str(family_dir), max_num_batched_tokens=32)  # chunked prefill on the way
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + [LONG_PROMPT]
    cold = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]  # one at a time
    reference = transformers_greedy(family_dir, [out.prompt_token_ids for out in cold], NUM_TOKENS)
    assert [out.token_ids for out in cold] == reference
    warm = llm.generate(prompts, params, use_tqdm=False)  # batched, and each prompt's full blocks cached
    assert [out.token_ids for out in warm] == reference
    assert warm[-1].num_cached_tokens >= 16 * ((len(warm[-1].prompt_token_ids) - 1) // 16) > 0


def test_bfloat16_cache_hits_change_no_token(family_dir):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    cached = make_llm(model=str(family_dir), dtype="bfloat16")
    first = [out.token_ids for out in cached.generate([LONG_PROMPT] + PROMPTS, params, use_tqdm=False)]
    again = cached.generate([LONG_PROMPT] + PROMPTS, params, use_tqdm=False)
    assert again[0].num_cached_tokens > 0
    uncached = make_llm(model=str(family_dir), dtype="bfloat16", enable_prefix_caching=False)
    off = [out.token_ids for out in uncached.generate([LONG_PROMPT] + PROMPTS, params, use_tqdm=False)]
    assert first == [out.token_ids for out in again] == off


def test_the_server_serves_the_family(family_dir):
    with LiveServer("--model", str(family_dir)) as live:
        body = {
            "model": family_dir.name,
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["token_ids"] == transformers_greedy(family_dir, [choice["prompt_token_ids"]], 8)[0]
