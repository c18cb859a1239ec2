"""PEFT adapters for the LoRA tests, written as peft's save_pretrained writes them."""

import torch
from model_helpers import reference_greedy

from prefixserve.model import ensure_default_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(directory, seed, targets=ALL_TARGETS, rank=8, alpha=16, rslora=False, scale=1.0, base_dir=None):
    """A random PEFT adapter of the built-in model (or the checkpoint at base_dir), as peft's save_pretrained
    writes it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir or ensure_default_model(), dtype=torch.float32)
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


def peft_greedy(adapter_path, prompt_ids, num_tokens: int, dtype=torch.float32, base_dir=None):
    """Greedy tokens of transformers + peft (the base alone for adapter_path None), each prompt alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir or ensure_default_model(), dtype=dtype).eval()
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_path)).eval()
    return reference_greedy(model, prompt_ids, num_tokens)
