"""Reasoning models: reasoning_effort (chat) and reasoning.effort (Responses) reach the chat template's thinking
switch (enable_thinking, as Qwen3's and SmolLM3's templates read it), and a thinking output's <think> text comes
back as reasoning_content / a reasoning item; a model without the switch refuses them naming the model.

The built-in model with a Qwen3-style template stands in for a reasoning model; its (gibberish) output is given
a thinking shape by a regex, so the split is exact."""

import json
import shutil

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error, openai_client

from prefixserve.server.reasoning import ReasoningStream, split_reasoning

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
SHAPE = {"regex": "<think>[a-z ]{3,20}</think>[a-z ]{3,20}"}  # vLLM's structured_outputs: a thinking turn's form


@pytest.fixture(scope="module")
def thinking_server(default_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(default_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    with LiveServer("--model", str(model), "--served-model-name", "tiny-thinking") as live:
        yield live


@pytest.fixture(scope="module")
def plain_server():
    with LiveServer() as live:
        yield live


def chat(server, **fields):
    body = {"model": "tiny-thinking", "messages": [{"role": "user", "content": "Think first."}], "max_tokens": 48}
    return httpx.post(server.url + "/v1/chat/completions", json={**body, **fields}, timeout=60)


def test_the_effort_reaches_the_template(thinking_server):
    tokenizer = thinking_server.engine.engine.tokenizer
    on = chat(thinking_server, reasoning_effort="high", max_tokens=1, return_token_ids=True).json()
    off = chat(thinking_server, reasoning_effort="none", max_tokens=1, return_token_ids=True).json()
    on_prompt = tokenizer.decode(on["choices"][0]["prompt_token_ids"], skip_special_tokens=False)
    off_prompt = tokenizer.decode(off["choices"][0]["prompt_token_ids"], skip_special_tokens=False)
    assert "<think>" not in on_prompt and off_prompt.endswith("<think>\n\n</think>\n\n")


def test_chat_returns_reasoning_content_whole_and_streamed(thinking_server):
    whole = chat(thinking_server, structured_outputs=SHAPE, temperature=0).json()["choices"][0]["message"]
    text = "<think>" + whole["reasoning_content"] + "</think>" + whole["content"]
    assert split_reasoning(text) == (whole["reasoning_content"], whole["content"])
    assert whole["reasoning_content"] and whole["content"] and "<think>" not in whole["content"]
    with httpx.stream(
        "POST",
        thinking_server.url + "/v1/chat/completions",
        json={
            "model": "tiny-thinking",
            "messages": [{"role": "user", "content": "Think first."}],
            "max_tokens": 48,
            "structured_outputs": SHAPE,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as response:
        chunks = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == whole["reasoning_content"]
    assert "".join(delta.get("content") or "" for delta in deltas) == whole["content"]


def test_responses_return_a_reasoning_item(thinking_server):
    """Thinking on, everything before </think> is reasoning: the tiny model's free text, which never closes the
    tag, is one reasoning item, the same whole and streamed."""
    client = openai_client(thinking_server)
    fields = {"model": "tiny-thinking", "input": "Think first.", "reasoning": {"effort": "medium"}, "temperature": 0}
    whole = client.responses.create(max_output_tokens=24, **fields)
    [reasoning] = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text and whole.output_text == ""
    events = list(client.responses.create(max_output_tokens=24, stream=True, **fields))
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text == events[-1].response.output[0].content[0].text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    off = client.responses.create(max_output_tokens=8, **{**fields, "reasoning": {"effort": "none"}})
    assert [item.type for item in off.output] == ["message"]


def test_a_model_without_the_switch_refuses_by_name(plain_server):
    response = httpx.post(
        plain_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
        timeout=30,
    )
    assert_openai_error(response, 400, "reasoning_effort", "unsupported_parameter")
    assert "prefixserve-tiny" in response.json()["error"]["message"]
    responses = httpx.post(
        plain_server.url + "/v1/responses", json={"input": "hi", "reasoning": {"effort": "low"}}, timeout=30
    )
    assert_openai_error(responses, 400, "reasoning.effort", "unsupported_parameter")


@pytest.mark.parametrize("step", [1, 2, 5, 9])
def test_the_stream_split_matches_the_whole(step):
    for text in ("<think>a b</think>answer", "<think>cut before the end", "no tags", "<thi", "</think>late"):
        stream = ReasoningStream()
        parts = [stream.push(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish()]
        reasoning, content = split_reasoning(text)
        assert "".join(part[0] for part in parts) == (reasoning or "")
        assert "".join(part[1] for part in parts) == content
