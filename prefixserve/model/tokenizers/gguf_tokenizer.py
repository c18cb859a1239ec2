"""A GGUF file's tokenizer metadata rebuilt as Hugging Face tokenizer files.

A GGUF carries no tokenizer.json: only the vocabulary (``tokenizer.ggml.tokens``, spelled as the
original tokenizer.json spelled it), the BPE merges, a type per token (1 normal, 3 control, 4
user-defined), the special token ids and the name of the pre-tokenizer llama.cpp should use
(``tokenizer.ggml.pre``). Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is rebuilt here
with the ``tokenizers`` library, splitting text with the same regular expressions as llama.cpp
(llama-vocab.cpp), so that ids match what the model was trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2_SPLIT = None  # tokenizers' ByteLevel(use_regex=True) is GPT-2's own expression
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    split: str | None  # a regex applied before byte-level mapping; None: GPT-2's
    digits_first: bool = False  # split every digit off on its own first (llama.cpp's "\p{N}" pass)
    ignore_merges: bool = False  # a whole word found in the vocabulary is one token (Llama 3)


# tokenizer.ggml.pre -> how llama.cpp splits text (llama-vocab.cpp, the regex_exprs switch).
PRE_TOKENIZERS = {
    "default": PreTokenizer(_GPT2_SPLIT),
    "gpt2": PreTokenizer(_GPT2_SPLIT),
    "smollm": PreTokenizer(_GPT2_SPLIT, digits_first=True),
    "starcoder": PreTokenizer(_GPT2_SPLIT, digits_first=True),
    "refact": PreTokenizer(_GPT2_SPLIT, digits_first=True),
    "codeshell": PreTokenizer(_GPT2_SPLIT, digits_first=True),
    "llama-bpe": PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": PreTokenizer(_QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenizer(_QWEN2_SPLIT),
}

# Tokens that end a turn, by name, as llama.cpp collects its end-of-generation set.
_END_OF_TURN_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def build_tokenizer_files(metadata: dict[str, Any], source: Path) -> TokenizerFiles:
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{source}: tokenizer model {model!r} is not supported; supported: gpt2 (byte-level BPE)")
    pre_name = metadata.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: pre-tokenizer {pre_name!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [_merge_pair(merge, source) for merge in metadata.get("tokenizer.ggml.merges") or []]
    pre = PRE_TOKENIZERS[pre_name]

    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole and are special (skipped when decoding);
    # user-defined ones (<think>) are matched whole but are text. Both keep their own ids.
    added = [
        AddedToken(token, normalized=False, special=kind == CONTROL)
        for token, kind in zip(tokens, token_types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    backend.add_special_tokens([token for token in added if token.special])
    backend.add_tokens([token for token in added if not token.special])
    for token in added:
        if backend.token_to_id(token.content) != tokens.index(token.content):
            raise ValueError(
                f"{source}: special token {token.content!r} appears twice in the vocabulary; "
                f"the tokenizer metadata is corrupt"
            )

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None, vocab)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    generation = {"eos_token_id": end_of_generation_ids(metadata, tokens, token_types)}
    if bos is not None:
        generation["bos_token_id"] = vocab[bos]
    return TokenizerFiles(backend.to_str(), config, generation)


def end_of_generation_ids(metadata: dict[str, Any], tokens: list[str], token_types: list[int]) -> list[int]:
    """eos, eot and eom ids from the metadata, then control tokens that end a turn by name
    (<|im_end|>, <|endoftext|>, ...), as llama.cpp stops on: a chat model that emits either
    ends its answer."""
    ids = [
        int(metadata[f"tokenizer.ggml.{key}"])
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if metadata.get(f"tokenizer.ggml.{key}") is not None
    ]
    ids += [
        index
        for index, (token, kind) in enumerate(zip(tokens, token_types))
        if kind in (CONTROL, USER_DEFINED) and token in _END_OF_TURN_NAMES
    ]
    return list(dict.fromkeys(ids))


def write_tokenizer_files(files: TokenizerFiles, directory: Path) -> None:
    (directory / "tokenizer.json").write_text(files.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(files.tokenizer_config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(files.generation_config, indent=2) + "\n")


def _pre_tokenizer(pre: PreTokenizer):
    steps = []
    if pre.digits_first:
        steps.append(pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    if pre.split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _post_processor(bos: str | None, eos: str | None, vocab: dict[str, int]):
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    special = [(token, vocab[token]) for token in (bos, eos) if token]
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head}$B:1{tail}",
        special_tokens=list(dict.fromkeys(special)),
    )


def _merge_pair(merge: str, source: Path) -> tuple[str, str]:
    # As llama.cpp: split at the first space after the first character (a merge's left side
    # is never empty, so a leading space belongs to it).
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(
            f"{source}: BPE merge {merge!r} has no space between its two parts; the tokenizer metadata is corrupt"
        )
    return merge[:cut], merge[cut + 1 :]
