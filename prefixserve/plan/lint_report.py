"""The lint's report: a summary table, then each family's findings with the line to change marked."""

from __future__ import annotations

import dataclasses
from typing import Any

from .lint import FamilyReport, HitRate, LintReport
from .lint_findings import Finding

QUOTE_WIDTH = 96  # characters of an offending line shown around its mark


def format_report(report: LintReport) -> list[str]:
    lines = [
        f"{report.num_requests} requests in {len(report.families)} prompt "
        f"famil{'y' if len(report.families) == 1 else 'ies'}, lengths in {report.unit}",
        f"hit rates: the log replayed in order through an unlimited prefix cache, blocks of {report.block_size} "
        f"{report.unit}",
        "",
    ]
    lines += _table(report)
    for family in report.families:
        lines += [""] + _family_lines(family, report.unit)
    return lines


def _table(report: LintReport) -> list[str]:
    header = ("family", "requests", "stable prefix", "first variable part", "hit rate today", "after fix")
    rows = [
        (
            f"{family.number} {family.model or '(no model)'} {family.kind}",
            str(family.num_requests),
            f"{family.stable_prefix_tokens:,}",
            _first_variable(family),
            _percent(family.today),
            _percent(family.after_fix),
        )
        for family in report.families
    ]
    rows.append(("all", str(report.num_requests), "", "", _percent(report.today), _percent(report.after_fix)))
    widths = [max(len(row[column]) for row in [header] + rows) for column in range(len(header))]
    right = (False, True, True, False, True, True)
    return [
        "  ".join(
            cell.rjust(width) if align else cell.ljust(width) for cell, width, align in zip(row, widths, right)
        ).rstrip()
        for row in [header] + rows
    ]


def _first_variable(family: FamilyReport) -> str:
    if not family.findings:
        return "none" if family.num_requests > 1 else "none (one request)"
    where = family.findings[0].location
    return f"{family.findings[0].kind} at {where.part.split(' ')[0]} {where.line}:{where.column}"


def _percent(hit_rate: HitRate) -> str:
    return f"{100 * hit_rate.rate:.1f}%"


def _family_lines(family: FamilyReport, unit: str) -> list[str]:
    line_numbers = [number for number in family.line_numbers if number]
    lines_text = f", log line{'s' if len(line_numbers) > 1 else ''} {_ranges(line_numbers)}" if line_numbers else ""
    lines = [
        f"Family {family.number}: {family.model or '(no model)'} {family.kind}, {family.num_requests} "
        f'request{"s" if family.num_requests != 1 else ""}{lines_text}: "{family.title}"',
        f"  stable prefix: {_length(family.stable_prefix_chars, family.stable_prefix_tokens, unit)}",
    ]
    if family.findings and family.stable_prefix_chars_after_fix != family.stable_prefix_chars:
        lines[-1] += (
            f"; after the fixes: "
            f"{_length(family.stable_prefix_chars_after_fix, family.stable_prefix_tokens_after_fix, unit)}"
        )
    if not family.findings:
        lines.append(
            "  no finding: the requests agree up to their own text"
            if family.num_requests > 1
            else "  no finding: one request, nothing to compare it with"
        )
    for number, finding in enumerate(family.findings, start=1):
        lines += _finding_lines(number, finding)
    lines.append(
        f"  hit rate: {_percent(family.today)} today ({family.today.num_hit:,} of "
        f"{family.today.num_prompt:,} {unit}), {_percent(family.after_fix)} after the fixes "
        f"({family.after_fix.num_hit:,} of {family.after_fix.num_prompt:,})"
    )
    return lines


def _length(num_chars: int, num_tokens: int, unit: str) -> str:
    return f"{num_chars:,} characters" + (f", {num_tokens:,} {unit}" if unit != "characters" else "")


def _finding_lines(number: int, finding: Finding) -> list[str]:
    where = finding.location
    examples = ", ".join(f'"{example}"' for example in finding.examples)
    head = f"  {number}. {finding.kind} at {where.part}, line {where.line}, column {where.column}"
    quoted, mark_start, mark_end = _window(finding.line_text, finding.mark_start, finding.mark_end)
    return [
        head + (f": {examples}" if examples else ""),
        f"       {quoted}",
        f"       {' ' * mark_start}{'^' * max(mark_end - mark_start, 1)}",
        f"     fix: {finding.suggestion}",
    ]


def _window(text: str, start: int, end: int) -> tuple[str, int, int]:
    """The part of a long line around [start, end), with "..." where it is cut."""
    end = min(end, start + QUOTE_WIDTH // 2)
    left = max(0, min(start - 16, end + 16 - QUOTE_WIDTH))
    right = min(len(text), left + QUOTE_WIDTH)
    prefix, suffix = ("..." if left else ""), ("..." if right < len(text) else "")
    return prefix + text[left:right] + suffix, start - left + len(prefix), end - left + len(prefix)


def _ranges(numbers: list[int]) -> str:
    """1,2,3,5 as "1-3, 5"."""
    ranges: list[list[int]] = []
    for number in numbers:
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    shown = [f"{first}-{last}" if last > first else str(first) for first, last in ranges[:6]]
    return ", ".join(shown) + (", ..." if len(ranges) > 6 else "")


def report_json(report: LintReport) -> dict[str, Any]:
    def rate(hit_rate: HitRate) -> dict[str, Any]:
        return {"hit_tokens": hit_rate.num_hit, "prompt_tokens": hit_rate.num_prompt, "rate": round(hit_rate.rate, 6)}

    families = []
    for family in report.families:
        entry = dataclasses.asdict(family)
        entry.update(num_requests=family.num_requests, today=rate(family.today), after_fix=rate(family.after_fix))
        families.append(entry)
    return {
        "unit": report.unit,
        "block_size": report.block_size,
        "num_requests": report.num_requests,
        "today": rate(report.today),
        "after_fix": rate(report.after_fix),
        "families": families,
    }
