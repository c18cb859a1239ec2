"""`prefixserve lint`: crafted request logs with known answers, bad input, the command end to end.

Lengths are in characters (no tokenizer) unless a test says otherwise, so the expected numbers can be
derived from the texts: `chat_text` writes a request out as the built-in chat template renders it, and
`expected_hits` is the hit count of an unlimited prefix cache worked out the slow way (the longest
common prefix with any earlier request, in whole blocks, never the block holding the last token).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from prefixserve.cli import main
from prefixserve.plan.lint import HitRate, lint_bodies, replay
from prefixserve.plan.lint_input import LintInputError, bodies_from_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lint" / "requests.jsonl"
BOS = "<|begin_of_text|>"
HEAD = BOS + "<|im_start|>system\n"
RULES = "You are the help desk of Example Corp.\nAnswer in one short paragraph.\nAlways be polite and precise."
QUESTIONS = ["How do I reset my password?", "Where is my invoice?", "Can I change my plan?", "Why is it slow?"]


def chat_text(messages: list[tuple[str, str]], tools: list[dict] = ()) -> str:
    text = BOS
    if tools:
        text += "<|im_start|>tools\n" + "\n".join(json.dumps(tool) for tool in tools) + "<|im_end|>\n"
    for role, content in messages:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def common_prefix(first: str, second: str) -> int:
    return next((index for index, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


def expected_hits(texts: list[str], block_size: int = 16) -> HitRate:
    num_hit = 0
    for index, text in enumerate(texts):
        shared = max((common_prefix(text, earlier) for earlier in texts[:index]), default=0)
        num_hit += min(shared // block_size, (len(text) - 1) // block_size) * block_size
    return HitRate(num_hit, sum(map(len, texts)))


def chat(system: str, question: str, model: str = "m", tools: list[dict] = ()) -> dict:
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return {**body, "tools": list(tools)} if tools else body


def tool(name: str, properties: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": properties},
        },
    }


# ---- the replay ------------------------------------------------------------------------------------------


def test_replay_counts_whole_blocks_and_recomputes_the_last_token():
    assert replay([list(range(32)), list(range(32))], 16) == HitRate(16, 64)  # block 2 holds the last token
    assert replay([list(range(33)), list(range(33))], 16) == HitRate(32, 66)
    assert replay([list(range(40)), list(range(20)) + [99] * 20], 16) == HitRate(16, 80)
    assert replay([[1] * 16 + [2] * 17, [3] * 16 + [2] * 17], 16) == HitRate(0, 66)  # same block, other parent


# ---- crafted logs with known answers -----------------------------------------------------------------------


def test_timestamp_on_the_first_line_of_the_system_prompt():
    times = [f"2026-01-0{day}T10:00:00Z" for day in range(1, 5)]
    bodies = [chat(f"Time: {time}\n{RULES}", question) for time, question in zip(times, QUESTIONS)]
    report = lint_bodies(bodies)
    (family,) = report.families
    assert family.num_requests == 4
    assert family.stable_prefix_chars == family.stable_prefix_tokens == len(HEAD + "Time: 2026-01-0") == 51
    (finding,) = family.findings
    assert (finding.kind, finding.location.part, finding.location.line, finding.location.column) == (
        "timestamp",
        "messages[0] (system)",
        1,
        7,
    )
    assert finding.line_text[finding.mark_start : finding.mark_end] == "2026-01-01T10:00:00Z"
    assert finding.examples == ("2026-01-01T10:00:00Z", "2026-01-02T10:00:00Z")
    assert finding.suggestion == (
        "move the timestamp on line 1 of the system message (messages[0]) to the end of the last user message"
    )
    today = [
        chat_text([("system", f"Time: {time}\n{RULES}"), ("user", question)])
        for time, question in zip(times, QUESTIONS)
    ]
    fixed = [
        chat_text([("system", f"Time: \n{RULES}"), ("user", f"{question}\n{time}")])
        for time, question in zip(times, QUESTIONS)
    ]
    assert family.today == report.today == expected_hits(today) == HitRate(144, 975)  # 3 x 48: 14.8%
    assert family.after_fix == expected_hits(fixed) == HitRate(480, 979)  # 3 x 160: 49.0%
    assert family.stable_prefix_chars_after_fix == len(HEAD + f"Time: \n{RULES}<|im_end|>\n<|im_start|>user\n") == 170


def test_uuid_request_id_then_hex_request_id():
    ids = [
        ("3b0f6a4e-8c1d-4f2a-9e7b-1a2b3c4d5e6f", "9f3a2b1c7d"),
        ("c47d2e19-0b5a-4e8f-8d6c-6f5e4d3c2b1a", "0b1c2d3e4f"),
    ]
    bodies = [
        chat(f"{RULES}\nRequest: {uuid}\nTrace: {trace}\nBe brief.", question)
        for (uuid, trace), question in zip(ids, QUESTIONS)
    ]
    (family,) = lint_bodies(bodies).families
    assert [(finding.kind, finding.location.line, finding.location.column) for finding in family.findings] == [
        ("uuid", 4, 10),
        ("request id", 5, 8),
    ]
    assert family.findings[1].examples == ("9f3a2b1c7d", "0b1c2d3e4f")
    fixed = [
        chat_text([("system", f"{RULES}\nRequest: \nTrace: \nBe brief."), ("user", f"{question}\n{uuid}\n{trace}")])
        for (uuid, trace), question in zip(ids, QUESTIONS)
    ]
    assert family.after_fix == expected_hits(fixed)


def test_user_name_early_in_the_system_prompt():
    names = ["Alice", "Bob", "Carol"]
    bodies = [chat(f"User: {name}\n{RULES}", question) for name, question in zip(names, QUESTIONS)]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.location.line, finding.location.column, finding.examples) == (
        "user name",
        1,
        7,
        ("Alice", "Bob"),
    )
    assert family.stable_prefix_chars == len(HEAD + "User: ")
    today = [
        chat_text([("system", f"User: {name}\n{RULES}"), ("user", question)])
        for name, question in zip(names, QUESTIONS)
    ]
    fixed = [
        chat_text([("system", f"User: \n{RULES}"), ("user", f"{question}\n{name}")])
        for name, question in zip(names, QUESTIONS)
    ]
    assert (family.today, family.after_fix) == (expected_hits(today), expected_hits(fixed))
    assert (family.today, family.after_fix) == (HitRate(64, 690), HitRate(320, 693))  # 2 x 32, 2 x 160


def test_shuffled_tool_order():
    tools = [
        tool("search", {"query": {"type": "string"}}),
        tool("get_invoice", {"id": {"type": "string"}}),
        tool("open_ticket", {"summary": {"type": "string"}}),
    ]
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    bodies = [chat(RULES, question, tools=[tools[i] for i in order]) for order, question in zip(orders, QUESTIONS)]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.location.part, finding.location.line) == ("tool order", "tools", 1)
    assert finding.examples == ("search, get_invoice, open_ticket", "open_ticket, search, get_invoice")
    assert finding.line_text[finding.mark_start : finding.mark_end] == '"search"'
    assert finding.suggestion.startswith("sort the tools by name")
    assert family.stable_prefix_chars == len(BOS + '<|im_start|>tools\n{"type": "function", "function": {"name": "')
    by_name = sorted(tools, key=lambda item: item["function"]["name"])
    fixed = [chat_text([("system", RULES), ("user", question)], by_name) for question in QUESTIONS[:3]]
    assert family.after_fix == expected_hits(fixed)
    assert (family.today, family.after_fix) == (HitRate(128, 2300), HitRate(1408, 2300))  # 2 x 64, 2 x 704


def test_json_key_order_in_tool_schemas_and_in_a_message():
    schemas = [
        {"city": {"type": "string"}, "days": {"type": "integer"}},
        {"days": {"type": "integer"}, "city": {"type": "string"}},
    ]
    bodies = [chat(RULES, question, tools=[tool("forecast", schema)]) for schema, question in zip(schemas, QUESTIONS)]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.examples) == ("key order", ("city, days", "days, city"))
    assert finding.line_text[finding.mark_start : finding.mark_end] == '"city"'
    assert finding.suggestion.startswith("serialize the tool schemas with sort_keys=True")
    fixed = [
        chat_text(
            [("system", RULES), ("user", question)], [json.loads(json.dumps(tool("forecast", schema), sort_keys=True))]
        )
        for schema, question in zip(schemas, QUESTIONS)
    ]
    assert family.after_fix == expected_hits(fixed)

    contexts = ['{"plan": "pro", "region": "eu"}', '{"region": "eu", "plan": "pro"}']
    bodies = [
        chat(f"{RULES}\nAccount: {context}\nThank the user.", question)
        for context, question in zip(contexts, QUESTIONS)
    ]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.location.line, finding.location.column) == ("key order", 4, 11)
    assert finding.suggestion == (
        "serialize the JSON on line 4 of the system message (messages[0]) with json.dumps(..., sort_keys=True)"
    )
    canonical = '{"plan": "pro", "region": "eu"}'
    assert family.stable_prefix_chars_after_fix == len(
        HEAD + f"{RULES}\nAccount: {canonical}\nThank the user.<|im_end|>\n<|im_start|>user\n"
    )


@pytest.mark.parametrize(
    "first, second, kind, value",
    [
        ("Today is March 3, 2025.", "Today is March 4, 2025.", "date", "March 3, 2025"),
        ("Today is 03/11/2025.", "Today is 04/11/2025.", "date", "03/11/2025"),
        (
            "Sent Mon, 3 Mar 2025 10:15:00 +0000",
            "Sent Tue, 4 Mar 2025 08:00:00 +0000",
            "timestamp",
            "Mon, 3 Mar 2025 10:15:00 +0000",
        ),
        ("Epoch 1740996900", "Epoch 1741083300", "timestamp", "1740996900"),
        ("Call id: req_8f2k1m9q", "Call id: req_7d3n0p2r", "request id", "req_8f2k1m9q"),
        (
            'Profile: {"username": "ann.lee", "tier": 2}',
            'Profile: {"username": "bo.chan", "tier": 2}',
            "user name",
            "ann.lee",
        ),
        ("Visitors online: 1234", "Visitors online: 987", "number", "1234"),
    ],
)
def test_detectors_name_what_varies(first, second, kind, value):
    bodies = [chat(f"{RULES}\n{line}\nThank you.", "Hi") for line in (first, second)]
    (family,) = lint_bodies(bodies).families
    finding = family.findings[0]
    assert (finding.kind, finding.location.line, finding.line_text[finding.mark_start : finding.mark_end]) == (
        kind,
        4,
        value,
    )
    assert finding.examples[0] == value and finding.examples[1] in second
    fixed = [
        chat_text([("system", f"{RULES}\n{line.replace(moved, '', 1)}\nThank you."), ("user", f"Hi\n{moved}")])
        for line, moved in zip((first, second), finding.examples)
    ]
    assert family.after_fix == expected_hits(fixed)


def test_two_variable_parts_are_found_in_order():
    bodies = [
        chat(f"Now: 2026-03-0{day} 09:30\n{RULES}\nName: {name}\nEnd.", question)
        for day, name, question in [(1, "Ann", QUESTIONS[0]), (2, "Ben", QUESTIONS[1])]
    ]
    (family,) = lint_bodies(bodies).families
    assert [(finding.kind, finding.location.line) for finding in family.findings] == [
        ("timestamp", 1),
        ("user name", 5),
    ]


def test_a_clean_log_has_no_finding_and_its_hit_rate_is_already_high():
    bodies = [chat(RULES * 3, question) for question in QUESTIONS]
    report = lint_bodies(bodies)
    (family,) = report.families
    assert family.findings == ()
    texts = [chat_text([("system", RULES * 3), ("user", question)]) for question in QUESTIONS]
    assert family.today == family.after_fix == expected_hits(texts) == HitRate(1056, 1659)  # 3 x 352: 63.7%
    assert family.stable_prefix_chars == len(texts[0]) - len(QUESTIONS[0]) - len("<|im_end|>\n<|im_start|>assistant\n")


def test_plain_text_that_differs_in_the_template_is_reported_and_not_rewritten():
    bodies = [chat(f"{RULES}\nSpeak {language}.", "Hi") for language in ("French", "German")]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.location.line, finding.location.column, finding.examples) == (
        "text",
        4,
        7,
        ("French.", "German."),
    )
    assert family.after_fix == family.today


def test_different_template_roles_are_a_structure_finding():
    bodies = [
        chat(RULES, "Hi"),
        {"model": "m", "messages": [{"role": "developer", "content": RULES}, {"role": "user", "content": "Hi"}]},
    ]
    (family,) = lint_bodies(bodies).families
    (finding,) = family.findings
    assert (finding.kind, finding.location.offset, finding.examples) == (
        "structure",
        len(BOS + "<|im_start|>"),
        (BOS + "<|im_start|>system", BOS + "<|im_start|>developer"),
    )
    assert family.after_fix == family.today


def test_a_date_in_a_tool_description_after_the_tool_order():
    def described(name: str, day: str) -> dict:
        return {"type": "function", "function": {"name": name, "description": f"Prices as of 2026-01-{day}."}}

    tool_lists = [[described("a", "01"), described("b", "09")], [described("b", "09"), described("a", "02")]]
    bodies = [chat(RULES, question, tools=tools) for tools, question in zip(tool_lists, QUESTIONS)]
    (family,) = lint_bodies(bodies).families
    assert [(finding.kind, finding.location.part, finding.location.line) for finding in family.findings] == [
        ("tool order", "tools", 1),
        ("date", "tools", 1),
    ]
    assert family.findings[1].suggestion == (
        "take the date out of the tool block (line 1 of the tool block); send it at the end of the last user message"
    )
    fixed = [
        chat_text(
            [("system", RULES), ("user", f"{question}\n2026-01-{day}")],
            [{"type": "function", "function": {"name": "a", "description": "Prices as of ."}}, described("b", "09")],
        )
        for day, question in zip(["01", "02"], QUESTIONS)
    ]
    assert family.after_fix == expected_hits(fixed)


def test_completions_bodies_and_a_prompt_list():
    prompts = [
        f"Date: 2026-05-1{day}\nTranslate into French.\nText: {text}" for day, text in [(1, "hello"), (2, "bye")]
    ]
    report = lint_bodies([{"model": "m", "prompt": prompts}, {"model": "m", "prompt": "Summarize: a report"}])
    first, second = report.families
    assert (first.kind, first.num_requests, second.num_requests) == ("completion", 2, 1)
    (finding,) = first.findings
    assert (finding.kind, finding.location.part, finding.location.line, finding.location.column) == (
        "date",
        "prompt",
        1,
        7,
    )
    assert finding.suggestion == "move the date on line 1 of the prompt to the end of the prompt"
    assert first.stable_prefix_chars == len("Date: 2026-05-1")
    fixed = [prompt.replace(date, "") + "\n" + date for prompt, date in zip(prompts, ["2026-05-11", "2026-05-12"])]
    assert (
        (first.today, first.after_fix)
        == (expected_hits(prompts), expected_hits(fixed))
        == (HitRate(0, 100), HitRate(32, 102))
    )


def test_families_split_on_model_and_on_the_template_not_on_its_values():
    bodies = [chat(f"Time: 2026-01-0{day}T10:00:00Z\n{RULES}", "Hi") for day in (1, 2)]
    bodies.insert(1, chat("You translate between English and German.\nKeep the tone.", "Hi"))
    bodies.append(chat(f"Time: 2026-01-03T10:00:00Z\n{RULES}", "Hi", model="other"))
    report = lint_bodies(bodies)
    assert [(family.model, family.num_requests) for family in report.families] == [("m", 2), ("m", 1), ("other", 1)]


def test_tokens_come_from_the_encoder_given():
    class Pairs:  # one token per two characters
        def encode(self, text: str, add_special_tokens: bool = True) -> list:
            return [text[index : index + 2] for index in range(0, len(text), 2)]

    bodies = [chat(f"Time: 2026-01-0{day}T10:00:00Z\n{RULES}", "Hi") for day in (1, 2)]
    (family,) = lint_bodies(bodies, Pairs(), block_size=4).families
    assert (family.stable_prefix_chars, family.stable_prefix_tokens) == (51, 25)
    assert family.today.num_prompt == sum(
        (len(chat_text([("system", f"Time: 2026-01-0{day}T10:00:00Z\n{RULES}"), ("user", "Hi")])) + 1) // 2
        for day in (1, 2)
    )


def test_the_lint_renders_chats_as_the_built_in_template_does():
    from prefixserve.commands.lint_command import _builtin_tokenizer
    from prefixserve.plan.lint import _encode
    from prefixserve.plan.lint_input import prompts_from_bodies

    tokenizer = _builtin_tokenizer()
    messages = [
        {"role": "system", "content": RULES},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    (prompt,) = prompts_from_bodies([{"messages": messages}])
    joined = [messages[0], {"role": "user", "content": "Hi there"}]
    assert _encode(prompt, tokenizer) == tokenizer.encode_chat(joined)


def test_batch_api_lines_and_log_line_numbers():
    lines = [
        json.dumps(
            {
                "custom_id": f"r{day}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": chat(f"Time: 2026-01-0{day}T10:00:00Z\n{RULES}", "Hi"),
            }
        )
        for day in (1, 2)
    ]
    report = lint_bodies(bodies_from_jsonl([lines[0], "", lines[1]]))
    (family,) = report.families
    assert (family.line_numbers, family.findings[0].kind) == ((1, 3), "timestamp")


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ([1, 2], "request 1 is a JSON array, not an object"),
        ({"model": "m"}, "request 1 has neither 'messages' (chat completions) nor 'prompt' (completions)"),
        ({"messages": "hi"}, "request 1: 'messages' is a JSON string (\"hi\"); it must be a non-empty list"),
        ({"messages": []}, "request 1: 'messages' is a JSON array ([]); it must be a non-empty list"),
        ({"messages": ["hi"]}, 'request 1: messages[0] is a JSON string ("hi"); each message must be an object'),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "request 1: messages[0].content is a JSON number (5); it must be a string or a list of content parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "request 1: messages[0].content[0] has no string 'text'",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "request 1: 'tools' is a JSON object"),
        ({"prompt": [1, 2, 3]}, "request 1: 'prompt' is a JSON array ([1, 2, 3]); the lint reads text prompts"),
    ],
)
def test_wrong_shapes_name_the_cause_and_the_fix(body, message):
    with pytest.raises(LintInputError) as raised:
        lint_bodies([body])
    assert str(raised.value).startswith(message)


def test_a_line_that_is_not_json_is_named():
    with pytest.raises(
        LintInputError,
        match=r"^line 2 is not JSON \(Expecting value at column 1\); the file must be "
        r"JSONL: one OpenAI request body per line$",
    ):
        bodies_from_jsonl(['{"prompt": "a"}', "not json"])
    with pytest.raises(LintInputError, match="^no requests: the input is empty"):
        bodies_from_jsonl(["", "  "])


# ---- the command -------------------------------------------------------------------------------------------


def write_log(path: Path, bodies: list) -> Path:
    path.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    return path


def test_cli_prints_the_report_and_writes_json(tmp_path, capsys):
    times = [f"2026-01-0{day}T10:00:00Z" for day in range(1, 5)]
    log = write_log(tmp_path / "log.jsonl", [chat(f"Time: {time}\n{RULES}", q) for time, q in zip(times, QUESTIONS)])
    assert main(["lint", str(log), "--no-tokenizer", "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"prefixserve lint {log}: 4 requests in 1 prompt family, lengths in characters"
    assert out[3].split() == [
        "family",
        "requests",
        "stable",
        "prefix",
        "first",
        "variable",
        "part",
        "hit",
        "rate",
        "today",
        "after",
        "fix",
    ]
    assert out[4].split() == ["1", "m", "chat", "4", "51", "timestamp", "at", "messages[0]", "1:7", "14.8%", "49.0%"]
    assert out[5].split() == ["all", "4", "14.8%", "49.0%"]
    assert "       Time: 2026-01-01T10:00:00Z" in out and "             ^^^^^^^^^^^^^^^^^^^^" in out
    assert out[-1] == f"wrote {tmp_path / 'out.json'}"
    saved = json.loads((tmp_path / "out.json").read_text())
    assert (saved["today"]["hit_tokens"], saved["after_fix"]["hit_tokens"], saved["unit"]) == (144, 480, "characters")
    assert saved["families"][0]["findings"][0]["kind"] == "timestamp"


def test_cli_reads_stdin_and_takes_the_block_size(monkeypatch, capsys):
    bodies = [chat(RULES * 3, question) for question in QUESTIONS]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(body) + "\n" for body in bodies)))
    assert main(["lint", "-", "--no-tokenizer", "--block-size", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prefixserve lint stdin: 4 requests in 1 prompt family, lengths in characters"
    texts = [chat_text([("system", RULES * 3), ("user", question)]) for question in QUESTIONS]
    hits = expected_hits(texts, 32)
    assert hits == HitRate(1056, 1659)  # blocks of 32 end where blocks of 16 do here: 11 x 32 = 22 x 16
    assert out[4].split()[-3:] == ["none", "63.7%", "63.7%"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "prefixserve lint: error: {path}: no such file; give the path of a JSONL request log, or '-' for stdin"),
        (
            '{"prompt": "a"}\n{oops\n',
            "prefixserve lint: error: line 2 is not JSON (Expecting property name enclosed in "
            "double quotes at column 2); the file must be JSONL: one OpenAI request body per "
            "line",
        ),
        (
            '"just a string"\n',
            "prefixserve lint: error: line 1 is a JSON string, not an object; each line must be one "
            'OpenAI request body, like {"model": ..., "messages": [...]}',
        ),
        (
            '{"model": "m", "input": "hi"}\n',
            "prefixserve lint: error: line 1 has neither 'messages' (chat completions) "
            "nor 'prompt' (completions); give the request body as sent to "
            "/v1/chat/completions or /v1/completions",
        ),
        (
            '{"messages": {"role": "user"}}\n',
            "prefixserve lint: error: line 1: 'messages' is a JSON object "
            '({"role": "user"}); it must be a non-empty list of {"role", '
            '"content"} objects',
        ),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "log.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["lint", str(path), "--no-tokenizer"]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", message.replace("{path}", str(path)) + "\n")


def test_readme_example_prints_what_the_readme_shows(capsys, monkeypatch):
    from docs_text import section as docs_section

    section = docs_section("Prompt cacheability lint")
    command = re.search(r"```bash\n(prefixserve lint [^\n]+)\n```", section).group(1)
    shown = re.search(r"```\n(prefixserve lint .*?\n)```", section, flags=re.S).group(1)
    monkeypatch.chdir(ROOT)
    assert main(command.split()[1:]) == 0
    assert capsys.readouterr().out == shown
