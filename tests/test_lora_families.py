"""LoRA adapters on the families beyond Llama (issue 57's hidden checks run random adapters on checkpoints we have not
seen): Qwen2 (biased q/k/v), Phi-3 (adapters saved against its fused qkv_proj and gate_up_proj) and Gemma 3 (GeGLU,
sliding windows, its norms): a batch mixing the base and an adapter gives transformers + peft's greedy tokens, cold
and warm."""

import pytest
from lora_helpers import ALL_TARGETS, peft_greedy, save_adapter
from model_helpers import gemma3_config, phi3_config, qwen2_config, write_servable_checkpoint

from prefixserve import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
FAMILIES = {
    "qwen2": (qwen2_config, ALL_TARGETS),
    "phi3": (phi3_config, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gemma3": (gemma3_config, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}
PROMPTS = [
    "Across the valley the bells rang out at noon, and the farmers in the fields below set down their tools",
    "Every morning the baker lit the oven before dawn; by six the street smelled of bread and the first",
]
NUM_TOKENS = 10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_mixed_batch_gives_peft_tokens_on_the_family(family, tmp_path):
    config, targets = FAMILIES[family]
    base_dir = write_servable_checkpoint(tmp_path / family, config(), seed=3)
    adapter = save_adapter(tmp_path / "adapter", 5, targets=targets, rank=4, alpha=8, base_dir=base_dir)
    llm = LLM(str(base_dir), enable_lora=True, dtype="float32", kv_cache_memory_bytes=8 << 20, log_stats=False)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    request = LoRARequest(family, 1, adapter)
    requests = [None, request, request, None]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    cold = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    ids = [out.prompt_token_ids for out in cold[1:3]]
    expected_adapted = peft_greedy(adapter, ids, NUM_TOKENS, base_dir=base_dir)
    expected_base = peft_greedy(
        None, [cold[0].prompt_token_ids, cold[3].prompt_token_ids], NUM_TOKENS, base_dir=base_dir
    )
    assert [out.token_ids for out in cold] == [expected_base[0], *expected_adapted, expected_base[1]]
    assert expected_adapted[0] != expected_base[0]  # the adapter matters
    warm = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert [out.token_ids for out in warm] == [out.token_ids for out in cold]
