"""Structured output: a grammar that decides, token by token, which next tokens may be chosen.

    StructuredOutputs   what a request asks for, exactly one of vLLM's fields: json (a JSON schema),
                        json_object (any JSON object), regex, choice (one of some strings), grammar
                        (Lark or llama.cpp's GBNF)
    GrammarCompiler     one per tokenizer and vocabulary: turns a request's StructuredOutputs into a
                        matcher (refusing one that does not compile with the reason)
    Grammar             one request's matcher: mask_row() bans the tokens the grammar forbids next,
                        accept() follows the token chosen, done says the grammar is complete

The grammar engine is llguidance (no dependencies, an abi3 wheel for every x86-64 and arm64 CPU). It
was picked by benchmarks/structured_mask.py: a mask of SmolLM2's 49,152 tokens for a JSON schema costs
about 40 us median, xgrammar's about 20 us, but xgrammar pulls triton and transformers into every
install. The mask acts on logits only: which prefix blocks are cached, and their K/V, never change.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import llguidance
import numpy as np
import torch

from .schema_finite import admits_finite_value

# JSON the model writes: compact (no free whitespace between tokens), so a random model's output ends.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 100_000
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (vLLM's StructuredOutputsParams): `json` a schema (dict or its JSON text),
    `json_object` True for any JSON object, `regex` a pattern the whole output matches, `choice` the
    strings the output is one of, `grammar` a Lark or GBNF grammar."""

    json: Union[dict, str, None] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of {list(KINDS)}, got {given or 'none'}")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        if self.choice is not None:
            if (
                isinstance(self.choice, (str, bytes))
                or not 0 < len(self.choice) <= MAX_CHOICES
                or any(not isinstance(option, str) or not option for option in self.choice)
            ):
                raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{kind} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("json must be a JSON schema: an object or its JSON text")
        size = len(self.json if isinstance(self.json, str) else json.dumps(self.json or "")) + sum(
            len(text) for text in (self.regex or "", self.grammar or "", *(self.choice or ()))
        )
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the structured output's grammar may be at most {MAX_GRAMMAR_CHARS} characters")
        object.__setattr__(self, "_grammar", self._compile())

    def grammar_text(self) -> str:
        """llguidance's grammar for the constraint (a Lark grammar or its JSON form), checked when made."""
        return self._grammar

    def _compile(self) -> str:
        try:
            grammar = self._grammar_of_kind()
        except Exception as error:  # ours and llguidance's (a schema it cannot read) name the problem
            raise ValueError(f"the structured output does not compile: {error}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise ValueError(f"the structured output does not compile: {problem}")
        return grammar

    def _grammar_of_kind(self) -> str:
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) else _parse_schema(self.json)
            if not admits_finite_value(schema):
                raise ValueError(
                    "the schema admits no finite JSON value: every instance would have to contain itself through "
                    "$ref; make the recursion optional (not required, anyOf with null, or minItems 0)"
                )
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
        return llguidance.grammar_from("grammar", self.grammar)


def _parse_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise ValueError(f"json must be a JSON schema; its text does not parse: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json must be a JSON schema: an object")
    return schema


class Grammar:
    """One request's matcher. Not thread-safe: the engine thread alone masks and accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def mask_row(self, row: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids next to -inf, in place."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: row.numel()]
        row.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))

    def accept(self, token_id: int) -> Optional[str]:
        """Follow the chosen token; None, or why the grammar refused it."""
        if self._matcher.consume_token(token_id):
            return None
        return f"structured output: {self._matcher.get_error() or f'token {token_id} breaks the grammar'}"

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token (the output is whole)."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Matchers for one tokenizer's vocabulary (`vocab_size`: the model's logits width)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        # The first mask of a vocabulary builds llguidance's token slices (seconds for 50k tokens): once, here.
        Grammar(self._matcher(StructuredOutputs(json_object=True)), vocab_size).mask_row(torch.zeros(vocab_size))

    def _matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, spec.grammar_text(), log_level=0)
        if matcher.is_error():  # checked without a vocabulary when made; this one's tokens may still fail it
            raise ValueError(f"the structured output does not compile: {matcher.get_error()}")
        return matcher

    def grammar(self, spec: StructuredOutputs, prior_output: Sequence[int] = ()) -> Grammar:
        """A matcher for `spec`, already past `prior_output` (tokens a continued stream produced)."""
        grammar = Grammar(self._matcher(spec), self.vocab_size)
        for token_id in prior_output:
            problem = grammar.accept(token_id)
            if problem is not None:
                raise ValueError(f"the continued output does not follow the structured output: {problem}")
        return grammar


_COMPILERS: dict[tuple[str, int], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()
_MAX_COMPILERS = 4  # a reload swaps tokenizers; older ones are dropped


def compiler_for(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The compiler of a tokenizer (built once per fingerprint and vocabulary size, thread-safe)."""
    key = (tokenizer.fingerprint, vocab_size)
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = GrammarCompiler(tokenizer.backend_json(), vocab_size, sorted(eos_token_ids))
            if len(_COMPILERS) >= _MAX_COMPILERS:
                _COMPILERS.pop(next(iter(_COMPILERS)))
            _COMPILERS[key] = compiler
        return compiler
