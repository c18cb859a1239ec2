"""Tokenizer: a Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library) plus its chat template.

No torch here. Behaviour follows transformers' fast tokenizers where a checkpoint relies on it:
``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json, when present, override what the
tokenizer.json post-processor adds; chat templates render in a sandboxed jinja2 environment with
the same options and helpers as transformers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from ..families.model_config import load_generation_eos

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=None)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def _decoder_types(state: Any) -> set[str]:
    """Type names of a tokenizers decoder, looking inside a Sequence."""
    if not isinstance(state, dict):
        return set()
    return {state.get("type")} | {kind for child in state.get("decoders", []) for kind in _decoder_types(child)}


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        tokenizer_config: dict[str, Any],
        chat_template: str | None,
        generation_eos_ids: Sequence[int],
        tokenizer_json: bytes,
    ):
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens = {key: _token_content(tokenizer_config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        self._add_bos = tokenizer_config.get("add_bos_token")  # None: the post-processor decides
        self._add_eos = tokenizer_config.get("add_eos_token")
        self._bos_id = self._token_id(self.special_tokens["bos_token"])
        eos_id = self._token_id(self.special_tokens["eos_token"])
        eos_ids = ([eos_id] if eos_id is not None else []) + list(generation_eos_ids)
        self._eos_ids = list(dict.fromkeys(eos_ids))  # ordered, without duplicates
        # Does the post-processor itself add BOS / EOS? Probe once, so encode() knows what to fix.
        plain = backend.encode("a", add_special_tokens=False).ids
        special = backend.encode("a", add_special_tokens=True).ids
        adds_tokens = len(special) > len(plain)
        self._post_adds_bos = adds_tokens and self._bos_id is not None and special[0] == self._bos_id
        self._post_adds_eos = adds_tokens and eos_id is not None and special[-1] == eos_id
        decoder = backend.decoder
        self._decoder_types = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._added_tokens = {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
        self._max_chars_per_token: int | None = None
        self._template = _compile_template(chat_template) if chat_template else None
        self.fingerprint = _fingerprint(
            tokenizer_json, chat_template, self.special_tokens, self._add_bos, self._add_eos, self._eos_ids
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found; expected a Hugging Face tokenizer directory with "
                f"tokenizer.json (convert a slow-only tokenizer by saving it with transformers)"
            )
        tokenizer_json = tokenizer_file.read_bytes()
        backend = BackendTokenizer.from_str(tokenizer_json.decode("utf-8"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(backend, config, _find_chat_template(path, config), load_generation_eos(path), tokenizer_json)

    # ---- properties ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def backend_json(self) -> str:
        """The tokenizer as Hugging Face tokenizers' JSON (what a grammar engine reads the vocabulary from)."""
        return self._backend.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`): a byte-level BPE token
        mapped back through GPT-2's byte alphabet, a byte-fallback token `<0xNN>` as that byte,
        an added / special token as its UTF-8 content, anything else as its decoded text."""
        if token_id in self._added_tokens:
            return self._added_tokens[token_id].encode()
        token = self._backend.id_to_token(token_id)
        if token is not None:
            if "ByteLevel" in self._decoder_types:
                byte_decoder = _gpt2_byte_decoder()
                if all(char in byte_decoder for char in token):
                    return bytes(byte_decoder[char] for char in token)
            if "ByteFallback" in self._decoder_types and (match := _BYTE_FALLBACK_TOKEN.fullmatch(token)):
                return bytes([int(match.group(1), 16)])
            if self._decoder_types & {"Metaspace", "Replace"}:  # SentencePiece: "\u2581" is a space
                return token.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def max_chars_per_token(self) -> int:
        """The most characters one token stands for, over the whole vocabulary (computed once).

        So a text of n characters encodes to at least ceil(n / max_chars_per_token) tokens: a
        cheap lower bound on its token count. Counted in bytes as well as decoded characters,
        since a character is never shorter in UTF-8 bytes and a token that ends inside one
        decodes alone to a single U+FFFD."""
        if self._max_chars_per_token is None:
            self._max_chars_per_token = max(
                max(len(self.token_bytes(token_id)), len(self.decode([token_id], skip_special_tokens=False)))
                for token_id in range(self.vocab_size)
            )
        return self._max_chars_per_token

    # ---- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos = self._bos_id
        if self._add_bos is True and not self._post_adds_bos and bos is not None:
            ids = [bos] + ids
        elif self._add_bos is False and self._post_adds_bos:
            ids = ids[1:]
        if self._add_eos is True and not self._post_adds_eos and self._eos_ids:
            ids = ids + [self._eos_ids[0]]
        elif self._add_eos is False and self._post_adds_eos:
            ids = ids[:-1]
        # A text that already starts with the BOS token (a rendered chat template usually does)
        # would get it twice; transformers keeps both, which silently degrades the model.
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render a chat to text. Encode the result with ``encode_chat`` semantics (no extra BOS)."""
        if self._template is None:
            raise ValueError(
                'this tokenizer has no chat template; add "chat_template" to tokenizer_config.json '
                "or a chat_template.jinja file, or send a plain prompt instead of messages"
            )
        variables = {key: value for key, value in self.special_tokens.items() if value is not None}
        variables.update(template_kwargs)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered chat (`tools` as transformers passes them; other variables, such as a thinking
        switch, as `template_kwargs`). The template supplies any BOS."""
        extra = {**template_kwargs, **({"tools": tools} if tools else {})}
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas for streaming and stop strings.

    Decoding one token alone is wrong twice over: a byte-level token can end inside a UTF-8
    character (it decodes to U+FFFD until the rest arrives), and SentencePiece-style decoders
    drop the leading space of the first token of a string. So each step decodes a short window
    that starts one already-emitted chunk back and emits only what that window adds::

        ids:   ... | prefix (already emitted) | read (new) |
               prefix_offset              read_offset

    A delta that ends in U+FFFD is held back until the character completes (or ``flush``).
    """

    _PROMPT_CONTEXT = 5  # prompt tokens kept so the first output token decodes in context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._PROMPT_CONTEXT :]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def push(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly complete text (possibly "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a truly invalid byte sequence) at the end of a stream."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as a serialized AddedToken.
    if isinstance(token, dict):
        return token.get("content")
    return token


def _find_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if template:
        return template
    jinja_file = path / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which chat templates must not do.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _fingerprint(
    tokenizer_json: bytes,
    chat_template: str | None,
    special_tokens: dict,
    add_bos: bool | None,
    add_eos: bool | None,
    eos_ids: list[int],
) -> str:
    digest = hashlib.sha256(tokenizer_json)
    digest.update(b"\0" + (chat_template or "").encode())
    config = {
        "special_tokens": special_tokens,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "eos_token_ids": eos_ids,
    }
    digest.update(b"\0" + json.dumps(config, sort_keys=True).encode())
    return digest.hexdigest()
