"""A cut never leaks markup: when max_tokens ends inside a tool call, every API (chat completions, Responses,
Messages), streamed or not, answers with the finished calls only, each of whose arguments parse, and never the
raw <tool_call> text. Greedy, so each cut is the same every run; the suite cuts at a spread of max_tokens,
`-m sweeps` at every one from 1 to 64."""

import json

import httpx
import pytest
from server_helpers import LiveServer

MARKUP = ("<tool_call>", "</tool_call>", "<tool_c", "tool_call>")
PARAMETERS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
}
QUESTION = "What will the weather be in Paris and in Oslo?"
SPREAD = (1, 2, 3, 5, 8, 13, 21, 34, 55, 64)


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def no_markup(text: str) -> None:
    assert not any(marker in text for marker in MARKUP), text


def sse(response) -> list[dict]:
    return [
        json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:") and line != "data: [DONE]"
    ]


def chat(server, max_tokens: int, stream: bool) -> None:
    body = {
        "model": "prefixserve-tiny",
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"type": "function", "function": {"name": "forecast", "parameters": PARAMETERS}}],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,
    }
    if not stream:
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        no_markup(message["content"] or "")
        for call in message.get("tool_calls") or []:
            json.loads(call["function"]["arguments"])
        return
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        chunks = sse(response)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk.get("choices")]
    no_markup("".join(delta.get("content") or "" for delta in deltas))
    for delta in deltas:
        for call in delta.get("tool_calls") or []:
            json.loads(call["function"]["arguments"])


def responses(server, max_tokens: int, stream: bool) -> None:
    body = {
        "model": "prefixserve-tiny",
        "input": QUESTION,
        "tools": [{"type": "function", "name": "forecast", "parameters": PARAMETERS}],
        "tool_choice": "required",
        "max_output_tokens": max_tokens,
        "stream": stream,
        "store": False,
        "temperature": 0,
    }
    if stream:
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as response:
            events = sse(response)
        no_markup("".join(event.get("delta", "") for event in events if event["type"] == "response.output_text.delta"))
        final = events[-1]["response"]
    else:
        final = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    for item in final["output"]:
        if item["type"] == "message":
            no_markup("".join(part["text"] for part in item["content"]))
        else:
            json.loads(item["arguments"])


def messages(server, max_tokens: int, stream: bool) -> None:
    body = {
        "model": "prefixserve-tiny",
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": "forecast", "input_schema": PARAMETERS}],
        "tool_choice": {"type": "any"},
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,
    }
    if not stream:
        for block in httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()["content"]:
            if block["type"] == "text":
                no_markup(block["text"])
            else:
                assert isinstance(block["input"], dict)
        return
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as response:
        events = sse(response)
    texts, arguments = [], {}
    for event in events:
        delta = event.get("delta", {})
        if delta.get("type") == "text_delta":
            texts.append(delta["text"])
        elif delta.get("type") == "input_json_delta":
            arguments[event["index"]] = arguments.get(event["index"], "") + delta["partial_json"]
    no_markup("".join(texts))
    for text in arguments.values():
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("api", [chat, responses, messages])
@pytest.mark.parametrize("stream", [False, True])
def test_cuts_answer_with_finished_calls_only(server, api, stream):
    for max_tokens in SPREAD:
        api(server, max_tokens, stream)


@pytest.mark.sweeps
@pytest.mark.parametrize("api", [chat, responses, messages])
@pytest.mark.parametrize("stream", [False, True])
def test_every_cut_from_1_to_64(server, api, stream):
    for max_tokens in range(1, 65):
        api(server, max_tokens, stream)
