"""Tokenizer: round trips, BOS handling, chat template, streaming detokenization, and agreement
with transformers' tokenizer loaded from the same directory."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.model import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🎉👩‍👩‍👧 and math ∑∫√",
    "def f(x):\n    return x ** 2  # code",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_special_tokens_and_vocab(tokenizer):
    assert tokenizer.vocab_size == 8192
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<|begin_of_text|>") == 0
    # <|end_of_text|> from tokenizer_config.json, <|im_end|> from generation_config.json
    assert tokenizer.eos_token_ids == [1, 3]
    assert tokenizer.token_to_id("<|im_start|>") == 2


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(CHAT)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False).endswith("Hi there<|im_end|>\n")
    ids = tokenizer.encode_chat(CHAT)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert ids[1] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.encode(text) == ids  # a rendered chat does not get a second BOS


@pytest.mark.parametrize("text", TEXTS[:4])
def test_incremental_decoder_never_emits_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer, prompt_ids=tokenizer.encode("Prompt:"))
    deltas = [decoder.push([token]) for token in ids] + [decoder.flush()]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == decoder.text == text


def test_incremental_decoder_holds_back_partial_utf8(tokenizer):
    emoji_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(emoji_ids) > 1  # the test needs a character split across tokens
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([token]) for token in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert decoder.push(emoji_ids[-1:]) == "🎉"


def test_transformers_tokenizer_agrees(tokenizer, default_model_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text), text
        plain = reference.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=False) == plain
    assert tokenizer.apply_chat_template(CHAT) == reference.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


def _copy(default_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(default_model_dir, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors")))


def test_fingerprint_follows_template(tokenizer, default_model_dir, tmp_path):
    assert Tokenizer.from_dir(default_model_dir).fingerprint == tokenizer.fingerprint
    copy = _copy(default_model_dir, tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    # Named templates, and the helpers transformers gives templates.
    config["chat_template"] = [
        {"name": "tool_use", "template": "unused"},
        {
            "name": "default",
            "template": "{% if messages|length == 0 %}{{ raise_exception('no messages') }}"
            "{% endif %}{{ messages[0]['content']|tojson }}",
        },
    ]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    changed = Tokenizer.from_dir(copy)
    assert changed.fingerprint != tokenizer.fingerprint
    assert changed.apply_chat_template([{"role": "user", "content": "é<"}]) == '"é<"'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no messages"):
        changed.apply_chat_template([])


def test_chat_template_jinja_file_fallback(default_model_dir, tmp_path):
    copy = _copy(default_model_dir, tmp_path)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(copy).chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(copy).apply_chat_template(CHAT)
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert Tokenizer.from_dir(copy).apply_chat_template(CHAT) == "[system][user]"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(token) for token in ids) == text.encode()
    split = [tokenizer.token_bytes(token) for token in tokenizer.encode("🎉", add_special_tokens=False)]
    assert len(split) > 1 and b"".join(split) == "🎉".encode()  # partial UTF-8 bytes, not U+FFFD


def test_token_bytes_of_special_and_byte_fallback_tokens(tokenizer):
    assert tokenizer.token_bytes(tokenizer.token_to_id("<|im_end|>")) == b"<|im_end|>"
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<0x0A>": 1, "\u2581hi": 2, "a": 3}
    backend = BackendTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sentencepiece = Tokenizer(backend, {}, None, [], b"{}")
    assert [sentencepiece.token_bytes(token) for token in (1, 2, 3)] == [b"\n", b" hi", b"a"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_max_chars_per_token_bounds_the_token_count_from_below(tokenizer, text):
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert num_tokens >= math.ceil(len(text) / tokenizer.max_chars_per_token)


def test_max_chars_per_token_is_the_longest_token(tokenizer):
    longest = max(range(tokenizer.vocab_size), key=lambda token: len(tokenizer.decode([token], False)))
    assert tokenizer.max_chars_per_token == len(tokenizer.decode([longest], False)) > 1
    text = tokenizer.decode([longest], False) * 3
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= 3
