"""`prefixserve lint`: how cacheable a log of prompts is, and what to move so more of it is.

Prefix caching rewards "stable first, variable last": a block is reused only if every token before
it is identical. Given OpenAI request bodies, the lint

1. groups them into prompt families: same model, same endpoint, and templates (the tool block and the
   leading system messages; a completion's text but its last line) that agree once detected values
   are masked and tools and keys sorted, on at least half their lines or in half their characters
   (shared at both ends);
2. per family, finds where the requests' rendered prompts stop agreeing (the stable prefix) and what
   is there (lint_findings.py), applies the fix to every request and looks again, until the requests
   agree up to their own text (the conversation, or a completion's last line) or the difference is
   plain text the lint cannot move;
3. replays the requests in log order through a prefix cache of unlimited size, at the engine's block
   granularity (the last prompt token is always recomputed), as sent and as fixed: the hit rates.

Lengths are counted in tokens of the given tokenizer (the server's blocks), or in characters, one
"token" per character, when there is none. Pure computation: no files, no model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

from ..cache import max_hit_blocks
from .lint_findings import Finding, classify
from .lint_input import Prompt, prompts_from_bodies
from .lint_patterns import canonical_json, mask

MAX_FINDINGS = 12  # per family: a log with more has one problem many times over
SIMILARITY = 0.5  # two templates this alike (lines or characters) are one family
COMPARED_FAMILIES = 64  # a new template is compared with this many of the latest families


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class CharacterEncoder:
    """One "token" per character: lengths and blocks in characters, for a lint without a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(map(ord, text))


@dataclass(frozen=True)
class HitRate:
    num_hit: int  # prompt tokens that a replay found cached
    num_prompt: int

    @property
    def rate(self) -> float:
        return self.num_hit / self.num_prompt if self.num_prompt else 0.0


@dataclass(frozen=True)
class FamilyReport:
    number: int  # 1-based, in order of first appearance
    model: str
    kind: str  # "chat" or "completion"
    title: str  # the template's first line, shortened
    line_numbers: tuple[int, ...]  # of the requests in the log (0 when given as bodies)
    stable_prefix_chars: int
    stable_prefix_tokens: int
    stable_prefix_chars_after_fix: int
    stable_prefix_tokens_after_fix: int
    findings: tuple[Finding, ...]
    today: HitRate
    after_fix: HitRate

    @property
    def num_requests(self) -> int:
        return len(self.line_numbers)


@dataclass(frozen=True)
class LintReport:
    unit: str  # "tokens" or "characters"
    block_size: int
    families: tuple[FamilyReport, ...]
    today: HitRate  # all requests through one cache, in log order
    after_fix: HitRate

    @property
    def num_requests(self) -> int:
        return sum(family.num_requests for family in self.families)


def lint_bodies(bodies: Iterable, encoder: Optional[Encoder] = None, block_size: int = 16) -> LintReport:
    """Lint OpenAI request bodies (or (line number, body) pairs); raises LintInputError on a wrong shape."""
    return lint_prompts(prompts_from_bodies(bodies), encoder, block_size)


def lint_prompts(prompts: Sequence[Prompt], encoder: Optional[Encoder] = None, block_size: int = 16) -> LintReport:
    if block_size < 1:
        raise ValueError(f"block size must be a positive number of tokens, got {block_size}")
    encoder = encoder or CharacterEncoder()
    unit = "characters" if isinstance(encoder, CharacterEncoder) else "tokens"
    tokens = [_encode(prompt, encoder) for prompt in prompts]
    families, fixed_tokens = [], list(tokens)
    for number, members in enumerate(group_families(prompts), start=1):
        family = [prompts[index] for index in members]
        findings, fixed = find_and_fix(family)
        if fixed != family:
            for index, prompt in zip(members, fixed):
                fixed_tokens[index] = _encode(prompt, encoder)
        families.append(
            _family_report(
                number,
                family,
                fixed,
                findings,
                [tokens[index] for index in members],
                [fixed_tokens[index] for index in members],
                block_size,
            )
        )
    return LintReport(unit, block_size, tuple(families), replay(tokens, block_size), replay(fixed_tokens, block_size))


def group_families(prompts: Sequence[Prompt]) -> list[list[int]]:
    """Indices of the prompts of each family, families in order of first appearance.

    A template seen before joins its family at once; a new one is compared with the latest
    COMPARED_FAMILIES families only, so a log of thousands of unrelated prompts stays linear."""
    families: list[list[int]] = []
    templates: list[tuple[str, str, str]] = []  # (model, kind, masked template) of each family's first prompt
    known: dict[tuple[str, str, str], int] = {}  # every masked template seen, to its family
    for index, prompt in enumerate(prompts):
        template = (prompt.model, prompt.kind, mask(_template_text(prompt)))
        family = known.get(template)
        if family is None:
            recent = range(len(templates) - 1, max(len(templates) - COMPARED_FAMILIES, 0) - 1, -1)
            family = next((number for number in recent if _same_family(templates[number], template)), None)
        if family is None:
            family = len(families)
            templates.append(template)
            families.append([])
        known[template] = family
        families[family].append(index)
    return families


def _template_text(prompt: Prompt) -> str:
    """The template as it would be with tools and keys in order: requests that differ only there are one family."""
    tools = sorted(canonical_json(tool) for tool in prompt.tools)
    return "\n".join(tools + [part.text for part in prompt.parts[: prompt.tail_index] if part.label != "tools"])


def _same_family(known: tuple[str, str, str], template: tuple[str, str, str]) -> bool:
    if known[:2] != template[:2]:
        return False
    if known[2] == template[2]:
        return True
    lines, other_lines = known[2].split("\n"), template[2].split("\n")
    shared = sum(min(lines.count(line), other_lines.count(line)) for line in set(lines))
    if shared >= SIMILARITY * max(len(lines), len(other_lines)):
        return True
    # One line that differs in a value the detectors do not know (a name mid-sentence): what the two share
    # at both ends. Linear, where a full diff would be quadratic on thousands of unrelated prompts.
    first, second = known[2], template[2]
    head = common_prefix_len([first, second])
    tail = common_prefix_len([first[head:][::-1], second[head:][::-1]])
    return head + tail >= SIMILARITY * max(len(first), len(second))


def find_and_fix(family: Sequence[Prompt]) -> tuple[tuple[Finding, ...], list[Prompt]]:
    """The findings of a family, first to last, and its requests with every fixable one fixed."""
    findings: list[Finding] = []
    current = list(family)
    while len(findings) < MAX_FINDINGS:
        texts = [prompt.render().text for prompt in current]
        stable = common_prefix_len(texts)
        other = next(
            (
                index
                for index, text in enumerate(texts)
                if common_prefix_len([texts[0], text]) == stable and text != texts[0]
            ),
            None,
        )
        if other is None or stable >= min(current[0].tail_start(), current[other].tail_start()):
            break  # the requests agree up to their own text: nothing left to move
        step = classify(current[0], current[other], stable)
        if findings and _same_place(findings[-1], step.finding):
            break  # the last fix did not move this difference: stop rather than report it again
        findings.append(step.finding)
        rewritten = [step.rewrite(prompt) for prompt in current] if step.rewrite else current
        if rewritten == current:
            break
        current = rewritten
    return tuple(findings), current


def _same_place(first: Finding, second: Finding) -> bool:
    return (first.kind, first.location.part, first.location.line, first.location.column) == (
        second.kind,
        second.location.part,
        second.location.line,
        second.location.column,
    )


def common_prefix_len(sequences: Sequence[Sequence]) -> int:
    return len(os.path.commonprefix(list(sequences))) if sequences else 0


def replay(prompts: Iterable[Sequence[int]], block_size: int) -> HitRate:
    """Hit tokens of prompts sent in order through an unlimited prefix cache of full blocks.

    A trie of blocks stands for the chained keys: a block is found only under the same blocks before it.
    As in the engine, at most (length - 1) // block_size blocks are matched: the last token is recomputed.
    """
    root: dict = {}
    num_hit = num_prompt = 0
    for token_ids in prompts:
        node, num_matchable = root, max_hit_blocks(len(token_ids), block_size, len(token_ids) // block_size)
        for index in range(len(token_ids) // block_size):
            block = tuple(token_ids[index * block_size : (index + 1) * block_size])
            if block in node and index < num_matchable:
                num_hit += block_size
            node = node.setdefault(block, {})
        num_prompt += len(token_ids)
    return HitRate(num_hit, num_prompt)


def _encode(prompt: Prompt, encoder: Encoder) -> list[int]:
    # A chat's rendering holds its own BOS, as the chat template does; a completion gets the tokenizer's.
    return encoder.encode(prompt.render().text, add_special_tokens=prompt.kind == "completion")


def _family_report(
    number: int,
    family: Sequence[Prompt],
    fixed: Sequence[Prompt],
    findings: tuple[Finding, ...],
    tokens: list[list[int]],
    fixed_tokens: list[list[int]],
    block_size: int,
) -> FamilyReport:
    first = family[0]
    title = next(
        (line for part in first.parts if part.label != "tools" for line in part.text.split("\n") if line.strip()), ""
    )
    if first.tools:
        title = f"[{len(first.tools)} tool{'s' if len(first.tools) != 1 else ''}] {title}"
    return FamilyReport(
        number,
        first.model,
        first.kind,
        title if len(title) <= 48 else title[:45] + "...",
        tuple(prompt.line_number for prompt in family),
        common_prefix_len([p.render().text for p in family]),
        common_prefix_len(tokens),
        common_prefix_len([p.render().text for p in fixed]),
        common_prefix_len(fixed_tokens),
        findings,
        replay(tokens, block_size),
        replay(fixed_tokens, block_size),
    )
