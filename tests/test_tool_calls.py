"""The tool-call parsers (server/tool_calls.py): whole outputs and streams split into content and calls alike,
in the hermes format (one block per call, or SmolLM2's list in one block) and llama3_json; what does not parse
stays content."""

import json
import random

import pytest

from prefixserve.server.tool_calls import ToolCallStream, parse

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2]}}]\n</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'


def names(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_blocks_and_a_list_in_one_block():
    content, calls = parse("hermes", HERMES)
    assert content == "Let me check."
    assert names(calls) == [("get_weather", {"city": "Paris"}), ("a", {}), ("b", {"x": [1, 2]})]


def test_llama3_json_calls_separated_by_semicolons():
    assert parse("llama3_json", LLAMA3) == (None, parse("llama3_json", LLAMA3[len("<|python_tag|>") :])[1])
    assert names(parse("llama3_json", LLAMA3)[1]) == [("f", {"x": 1}), ("g", {})]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", "no call <tool_call> {broken"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": "x"}</tool_call>'),
        ("llama3_json", 'text {"name": "f"}'),
        ("llama3_json", '{"name": "f", "parameters": {}} trailing'),
        ("llama3_json", '{"no": "name"}'),
    ],
)
def test_what_does_not_parse_stays_content(parser, text):
    assert parse(parser, text) == (text, [])


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", HERMES),
        ("llama3_json", LLAMA3),
        ("hermes", "plain text < and <t"),
        ("llama3_json", "plain text"),
        ("hermes", "a <tool_call>{oops"),
    ],
)
def test_a_stream_in_any_pieces_gives_the_whole_outputs_calls(parser, text):
    rng = random.Random(len(text))
    for _ in range(20):
        stream, content, calls, position = ToolCallStream(parser), "", [], 0
        while position < len(text):
            size = rng.randint(1, 7)
            piece, more = stream.push(text[position : position + size])
            content, calls, position = content + piece, calls + more, position + size
        piece, more = stream.finish()
        content, calls = content + piece, calls + more
        whole_content, whole_calls = parse(parser, text)
        assert names(calls) == names(whole_calls) and stream.calls == calls
        assert content.strip() == (whole_content or "").strip()


def test_offline_chat_takes_tools_as_the_server_renders_them(default_model_dir):
    from conftest import make_llm

    from prefixserve.chat_tools import render_chat

    llm = make_llm()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    with_tools = llm.chat(messages, tools=tools, params=None, use_tqdm=False)[0]
    plain = llm.chat(messages, use_tqdm=False)[0]
    rendered, _ = render_chat(messages, tools, reads_tools=False)
    assert with_tools.prompt_token_ids == llm.tokenizer.encode_chat(rendered)
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)


@pytest.mark.parametrize(
    "parser, text, calls",
    [
        ("hermes", CALL_F + "\n<tool_call>\n", ["f"]),  # cut right after the next call's marker and newline
        ("hermes", CALL_F + '\n<tool_call>\n{"name": "g", "argu', ["f"]),
        ("hermes", "Sure. <tool_c", []),  # cut inside the marker
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "par', ["f"]),
    ],
)
def test_a_cut_keeps_the_finished_calls_and_drops_the_rest(parser, text, calls):
    content, parsed = parse(parser, text, cut=True)
    assert [call.name for call in parsed] == calls
    assert "<tool" not in (content or "") and '"g"' not in (content or "")
    stream = ToolCallStream(parser)
    pushed = [stream.push(text[i : i + 5]) for i in range(0, len(text), 5)]
    finished = stream.finish(cut=True)
    sent = "".join(content for content, _ in pushed) + finished[0]
    assert "<tool" not in sent and [call.name for call in stream.calls] == calls


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", CALL_F + "\n" + CALL_F),
        ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "f", "parameters": {}}'),
    ],
)
def test_parallel_tool_calls_false_keeps_the_first_call_only(parser, text):
    """parallel_tool_calls false (Anthropic's disable_parallel_tool_use) with tool_choice auto, where no grammar
    limits the calls: the first is the answer, later ones are dropped, never sent as text."""
    content, calls = parse(parser, text, max_calls=1)
    assert len(calls) == 1 and "<tool" not in (content or "") and '"f"' not in (content or "")
    stream = ToolCallStream(parser, max_calls=1)
    sent = [stream.push(text[i : i + 7]) for i in range(0, len(text), 7)] + [stream.finish()]
    assert len(stream.calls) == 1 and sum(len(calls) for _, calls in sent) == 1
    assert "<tool" not in "".join(content for content, _ in sent)
