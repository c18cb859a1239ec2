"""Tools over HTTP through the official openai client: tool_choice "required" and a named function are enforced
(every call parses, names an offered function and follows its schema), streamed as tool_calls deltas; a tool's
result continues the conversation and hits the cache; a template that reads tools renders them as transformers
does; the router tokenizes a chat with tools as the replica does; bad tool requests are 400s naming the field."""

import json
import shutil

import httpx
import jsonschema
import pytest
from server_helpers import LiveServer, assert_openai_error, openai_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
SYSTEM = {"role": "system", "content": "You are an agent. Use the tools when they help. " * 6}
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def ask(client, messages, **fields):
    fields = {"max_tokens": 80, "temperature": 0, **fields}
    return client.chat.completions.create(model="prefixserve-tiny", messages=messages, tools=TOOLS, **fields)


def check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.1])
def test_required_gives_calls_that_follow_their_schemas(client, temperature):
    reply = ask(client, [SYSTEM, USER], tool_choice="required", temperature=temperature, seed=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once(client):
    reply = ask(client, [SYSTEM, USER], tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1
    check_calls(calls, names=("get_time",))


def test_streamed_calls_arrive_as_tool_calls_deltas(client):
    stream = ask(client, [SYSTEM, USER], tool_choice="required", stream=True)
    calls, finish_reasons, content = {}, [], ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                calls.setdefault(delta.index, delta)
            finish_reasons.append(choice.finish_reason)
    assert content == "" and finish_reasons[-1] == "tool_calls"
    check_calls([calls[index] for index in sorted(calls)])
    whole = ask(client, [SYSTEM, USER], tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        (calls[i].function.name, calls[i].function.arguments) for i in sorted(calls)
    ]


def test_a_tool_result_continues_the_conversation_from_the_cache(client):
    first = ask(client, [SYSTEM, USER], tool_choice="required")
    message = first.choices[0].message
    turn = [
        SYSTEM,
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ],
        },
    ]
    turn += [{"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'} for call in message.tool_calls]
    second = ask(client, turn, tool_choice="auto")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    # everything the first turn's prompt held is reused, in whole blocks
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16


def test_auto_and_none_leave_the_text_alone_when_the_model_calls_nothing(client):
    for choice in ("auto", "none"):
        reply = ask(client, [SYSTEM, USER], tool_choice=choice, max_tokens=8)
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        *[
            (
                {
                    "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": parameters}}],
                    **choice,
                },
                "tools.1.function.parameters",
            )
            for parameters in (
                {"type": "nope"},  # not a schema
                {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # no finite call
            )
            for choice in ({"tool_choice": "required"}, {"tool_choice": "auto"}, {})  # auto may call it too
        ],
    ],
)
def test_a_tool_request_that_cannot_be_served_is_a_400_naming_the_field(server, fields, param):
    response = httpx.post(
        server.url + "/v1/chat/completions", timeout=30, json={"messages": [USER], "max_tokens": 4, **fields}
    )
    assert_openai_error(response, 400, param)


def test_a_tool_call_whose_arguments_are_not_json_is_refused(server):
    messages = [
        USER,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{nope"}}
            ],
        },
    ]
    response = httpx.post(
        server.url + "/v1/chat/completions", timeout=30, json={"messages": messages, "tools": TOOLS, "max_tokens": 4}
    )
    assert_openai_error(response, 400, "messages", code="invalid_messages")


QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else 'Hi.' }}"
    "\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and tools %}{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    '{%- for call in message.tool_calls or [] %}\n<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}'
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_reads_tools_renders_them_as_transformers_does(default_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from prefixserve.chat_tools import render_chat
    from prefixserve.model.tokenizers.tokenizer import Tokenizer

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_LIKE_TEMPLATE}))
    messages = [
        SYSTEM,
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    ours = Tokenizer.from_dir(directory)
    rendered, tools = render_chat(messages, TOOLS, reads_tools=True)
    theirs = AutoTokenizer.from_pretrained(directory)
    expected_messages = [
        dict(
            m,
            tool_calls=[
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        )
        if "tool_calls" in m
        else m
        for m in messages
    ]
    expected = theirs.apply_chat_template(expected_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(rendered, tools=tools) == expected
    assert '"arguments": {"city": "Oslo", "unit": "C"}' in expected and "<tools>" in expected


def test_the_router_tokenizes_a_chat_with_tools_as_the_replica_does(server):
    import asyncio

    from prefixserve.router.inbound import read_request
    from prefixserve.server.inputs import RequestBuilder
    from prefixserve.server.protocol import ChatCompletionRequest

    body = {
        "messages": [
            SYSTEM,
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        "tools": TOOLS,
    }
    tokenizer = server.engine.engine.tokenizer
    replica = asyncio.run(RequestBuilder(server.engine, 256).chat_prompt(ChatCompletionRequest.model_validate(body)))

    def router_tokens(chat: dict) -> list[int]:
        return read_request(json.dumps(chat).encode(), "/v1/chat/completions", tokenizer, 4096, 10**6).token_ids

    assert router_tokens(body) == replica
    assert len(replica) > len(router_tokens({"messages": body["messages"][:2]}))
