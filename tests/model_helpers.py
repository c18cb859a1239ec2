"""Helpers shared by the tests/test_model_*.py files (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from prefixserve.model import AttentionMetadata, LlamaForCausalLM

BLOCK_SIZE = 16


# ---- small random checkpoints ------------------------------------------------------------------


def write_random_checkpoint(directory: Path, config: dict, seed: int = 0) -> Path:
    """config.json + model.safetensors with names and shapes taken from transformers' own model.

    The scales keep logits well separated (std of a few units), so greedy decoding does not
    depend on float noise; see prefixserve/model/default.py.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in sorted(reference.state_dict().items()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w): the same gains from w near 0
            std, mean = 0.1, (0.0 if config["model_type"].startswith("gemma") else 1.0)
        elif name.endswith(".bias"):
            std, mean = 0.1, 0.0
        elif name == "model.embed_tokens.weight":
            std, mean = (0.3 if config.get("tie_word_embeddings") else 1.0), 0.0
        elif name == "lm_head.weight":
            std, mean = 0.3, 0.0
        else:
            sharpen = 2.0 if (".q_proj." in name or ".k_proj." in name) else 1.0
            std, mean = sharpen / math.sqrt(shape[1]), 0.0
        tensors[name] = mean + std * torch.randn(shape, generator=generator)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def write_qwen2_checkpoint(directory: Path, seed: int) -> Path:
    """A random Qwen2-style checkpoint (q/k/v bias, tied, 6/2 heads) with the built-in model's tokenizer."""
    return write_servable_checkpoint(directory, qwen2_config(), seed)


def write_servable_checkpoint(directory: Path, config: dict, seed: int) -> Path:
    """A random checkpoint of `config` with the built-in model's tokenizer: what `serve --model` and LLM load."""
    import shutil

    from prefixserve.model import ensure_default_model

    write_random_checkpoint(directory, config, seed=seed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ensure_default_model() / name, directory / name)
    return directory


def qwen2_config(vocab_size: int = 8192) -> dict:
    """Qwen2 style: q/k/v bias, tied embeddings, GQA 6/2, explicit head_dim (6 * 32 != hidden)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def qwen3_config(vocab_size: int = 8192) -> dict:
    """Qwen3 style: RMSNorm on each q and k head, no biases, untied, head_dim 64 apart from hidden / heads; the
    second layer slides over 24 keys (use_sliding_window from max_window_layers on)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "use_sliding_window": True,
        "sliding_window": 24,
        "max_window_layers": 1,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def smollm3_config(vocab_size: int = 8192) -> dict:
    """SmolLM3 style: every third layer without rotary (NoPE), tied embeddings, GQA 4/1."""
    return {
        "architectures": ["SmolLM3ForCausalLM"],
        "model_type": "smollm3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "no_rope_layer_interval": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def mistral_config(vocab_size: int = 8192) -> dict:
    """Mistral: every layer slides over 18 keys, so the ~40-token test prompts outrun it."""
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "sliding_window": 18,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def phi3_config(vocab_size: int = 8192) -> dict:
    """Phi-3 style: q/k/v and gate/up stored fused, untied, 4 heads of 32."""
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "original_max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def phi3_longrope_config(vocab_size: int = 8192) -> dict:
    """Phi-3 128k style LongRoPE with a pre-training length of 24 tokens: the test prompts of 5-12 tokens grow
    past it while generating (recomputed with the long factors, as transformers does) and the longer one starts
    past it. The two factor sets differ enough that a row rotated with the wrong one changes the tokens."""
    return {
        **phi3_config(vocab_size),
        "original_max_position_embeddings": 24,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(16)],
            "long_factor": [1.0 + 0.9 * i for i in range(16)],
        },
    }


def phi4_mini_config(vocab_size: int = 8192) -> dict:
    """Phi-4-mini style: LongRoPE on the first 3/4 of each head (partial_rotary_factor), 2 KV heads, tied."""
    return {
        **phi3_config(vocab_size),
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 24,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [2.0 + 1.5 * i for i in range(12)],
        },
    }


def gemma3_config(vocab_size: int = 8192) -> dict:
    """Gemma 3 text: GeGLU, (1 + w) norms, q/k norms, query_pre_attn_scalar apart from head_dim, a global layer
    (linear rope scaling) between two local ones (their own rope base), a final logit cap. Untied: tied random
    weights times Gemma's sqrt(hidden) embedding scale make a model that repeats its last token."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 512,
        "sliding_window": 20,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def gemma2_config(vocab_size: int = 8192) -> dict:
    """Gemma 2: Gemma 3's norms, GeGLU and embedding scale without q/k norms, a local layer (window 18) between
    global ones, one rope base, and caps low enough to bend these small random scores (3) and logits (8). Untied
    (see gemma3_config)."""
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 48,
        "max_position_embeddings": 512,
        "sliding_window": 18,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 8.0,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": False,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def llama3_config(vocab_size: int = 8192) -> dict:
    """Llama 3.1 style rope scaling; original_max_position_embeddings is small so that the
    ~40-token test prompts exercise all three frequency bands of the llama3 formula."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 320,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


# ---- running our model over a paged cache --------------------------------------------------------


class PagedSequences:
    """Owns per-layer KV caches and runs steps for several sequences with given block tables."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = BLOCK_SIZE):
        config = model.config
        param = model.embed_tokens.weight
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            (torch.zeros(shape, dtype=param.dtype), torch.zeros(shape, dtype=param.dtype))
            for _ in range(config.num_hidden_layers)
        ]

    @torch.inference_mode()
    def step(
        self,
        chunks: list[list[int]],
        contexts_before: list[int],
        tables: list[list[int]],
        output_rows: Optional[list[int]] = None,
    ) -> torch.Tensor:
        """Run one step; chunk i continues a sequence that already has contexts_before[i] tokens
        cached. Returns float32 logits for every input token, flat [sum(len(chunk)), vocab], or
        for `output_rows` only (the model's last layer then computes those rows alone)."""
        query_lens = [len(chunk) for chunk in chunks]
        seq_lens = [before + query_len for before, query_len in zip(contexts_before, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        input_ids = torch.tensor([token for chunk in chunks for token in chunk])
        positions = torch.tensor(
            [p for before, n in zip(contexts_before, query_lens) for p in range(before, before + n)]
        )
        hidden = self.model(input_ids, positions, self.kv_caches, meta, output_rows=output_rows)
        return self.model.compute_logits(hidden)


def greedy_paged(model: LlamaForCausalLM, prompt: list[int], num_tokens: int, table: list[int]) -> list[int]:
    """Greedy decoding: one prefill step, then one-token decode steps, all through the paged cache."""
    runner = PagedSequences(model)
    logits = runner.step([prompt], [0], [table])
    output = [int(logits[-1].argmax())]
    while len(output) < num_tokens:
        context = len(prompt) + len(output) - 1
        logits = runner.step([[output[-1]]], [context], [table])
        output.append(int(logits[-1].argmax()))
    return output


def reference_greedy(model, prompt_ids, num_tokens: int) -> list[list[int]]:
    """A transformers (or peft) model's greedy tokens after each prompt, exactly num_tokens each."""
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            # An explicit mask: the BOS id may equal the pad id, which generate() would mask out.
            input_ids = torch.tensor([ids])
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs
