"""Maintainer tool: train the byte-level BPE tokenizer of the built-in default model.

Not used at runtime. Its output, ``data/tokenizer.json`` and ``data/tokenizer_config.json``, is
committed as package data, and ``default.py`` copies those files into the generated model
directory. Re-running it changes the tokenizer (and so the tokenizer fingerprint), so only do
that together with a new default-model version (``prefixserve-tiny-v2``).

    python -m prefixserve.model.tokenizers.make_tokenizer [OUTPUT_DIR]

Training text: the English prose of the Python documentation topics (``pydoc_data/topics.py``)
and the top-level standard-library modules of the running interpreter, in sorted order, so the
result depends only on the Python version (3.11.7 produced the committed files) and
``tokenizers``. No download is needed.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN]  # ids 0..3

# ChatML. The template starts with the BOS token, the Hugging Face convention: a rendered chat is
# encoded with add_special_tokens=False, so the BOS must come from the template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / "pydoc_data" / "topics.py"]
    files += sorted(stdlib.glob("*.py"))
    return [str(path) for path in files]


def train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # GPT-2 style: split on the GPT-2 regex, map bytes to printable characters, no prefix space.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(training_files(), trainer)
    # The BOS is added by the post-processor, so both our Tokenizer and transformers'
    # PreTrainedTokenizerFast prepend it on encode(add_special_tokens=True).
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else Path(__file__).parents[1] / "data"
    out_dir.mkdir(parents=True, exist_ok=True)
    train().save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"wrote {out_dir}/tokenizer.json and tokenizer_config.json")


if __name__ == "__main__":
    main(sys.argv[1:])
