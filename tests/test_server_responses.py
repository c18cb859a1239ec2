"""OpenAI's Responses API through the official openai client: plain, streamed, stored and continued with
previous_response_id (its turn reusing the last turn's tokens from the cache), tools, text.format, tenancy."""

import json

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error, openai_client

MODEL = "prefixserve-tiny"
INSTRUCTIONS = "You are prefixserve's test assistant. Answer briefly and precisely. " * 6
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {  # enums: the tiny random model's calls close within a few tokens
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    with LiveServer("--api-keys-file", str(keys), "--responses-max-stored", "8") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    client = openai_client(server)
    client.api_key = "key-a"
    return client


def create(client, prompt="What is a prefix cache?", **kwargs):
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=prompt, temperature=0, **kwargs)


def test_a_response_as_the_sdk_reads_it(client):
    response = create(client)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.output_tokens == 12 and usage.total_tokens == usage.input_tokens + 12
    assert create(client).output_text == response.output_text  # greedy: the same again, now from the cache
    assert create(client).usage.input_tokens_details.cached_tokens > 0


def test_the_stream_sends_the_typed_events_and_ends_with_the_stored_object(client):
    whole = create(client, "Stream this answer.")
    events = list(create(client, "Stream this answer.", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_from_the_cached_tokens(server, client):
    first = create(client, "Name a color.", max_output_tokens=16)
    second = create(client, "Name another one.", previous_response_id=first.id, max_output_tokens=8)
    # turn 2's prompt starts with turn 1's prompt and output tokens: all of them cached but the last partial block
    assert second.usage.input_tokens > first.usage.total_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (first.usage.total_tokens // 16) * 16 - 16
    assert second.previous_response_id == first.id
    store = server.app.state.server.responses
    done = store.get(first.id, "tenant-a").prompt_ids + store.get(first.id, "tenant-a").output_ids
    assert store.get(second.id, "tenant-a").prompt_ids[: len(done)] == done  # exactly the tokens turn 1 computed
    third = create(client, "And a third.", previous_response_id=second.id, max_output_tokens=8)
    assert third.usage.input_tokens_details.cached_tokens >= (second.usage.total_tokens // 16) * 16 - 16
    items = client.responses.input_items.list(second.id).data
    assert [(item.type, item.role) for item in items] == [("message", "user")]
    assert items[0].content[0].text == "Name another one."
    many = create(
        client,
        [{"role": "user", "content": f"Part {i}."} for i in range(5)],
        max_output_tokens=1,
    )
    newest = client.responses.input_items.list(many.id, limit=2)
    assert [item.content[0].text for item in newest.data] == ["Part 4.", "Part 3."] and newest.has_more
    rest = client.responses.input_items.list(many.id, limit=10, after=newest.last_id, order="desc")
    assert [item.content[0].text for item in rest.data] == ["Part 2.", "Part 1.", "Part 0."] and not rest.has_more
    oldest = client.responses.input_items.list(many.id, order="asc", limit=1).data
    assert oldest[0].content[0].text == "Part 0."


def test_stored_responses_are_their_tenants_own_and_can_be_deleted(server, client):
    response = create(client, "Keep this.")
    other = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-b"}, timeout=30)
    for answer in (
        other.get(f"/v1/responses/{response.id}"),
        other.get(f"/v1/responses/{response.id}/input_items"),
        other.delete(f"/v1/responses/{response.id}"),
        other.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": response.id}),
    ):  # another tenant's id reads as a missing one: never its content
        assert answer.status_code == 404 and "Keep this" not in answer.text
    assert client.responses.retrieve(response.id).id == response.id  # still there for its own tenant
    client.responses.delete(response.id)
    missing = httpx.get(f"{server.url}/v1/responses/{response.id}", headers={"Authorization": "Bearer key-a"})
    assert_openai_error(missing, 404, param="response_id", code="response_not_found")
    unstored = create(client, "Do not keep this.", store=False)
    gone = httpx.get(f"{server.url}/v1/responses/{unstored.id}", headers={"Authorization": "Bearer key-a"})
    assert gone.status_code == 404


def test_the_store_is_bounded(server, client):
    ids = [create(client, f"Turn {i}.", max_output_tokens=1).id for i in range(10)]
    assert len(server.app.state.server.responses) == 8
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    old = httpx.get(f"{server.url}/v1/responses/{ids[0]}", headers={"Authorization": "Bearer key-a"})
    assert old.status_code == 404


def test_a_tool_round_trip(client):
    called = create(
        client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=64
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    answered = create(
        client,
        [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}],
        previous_response_id=called.id,
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert answered.output and answered.usage.input_tokens_details.cached_tokens > 0


def test_streamed_tool_calls_arrive_as_function_call_items(client):
    events = list(
        create(client, "Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=64, stream=True)
    )
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(done) >= 1 and all(json.loads(event.arguments) is not None for event in done)
    final = events[-1].response
    assert [item.type for item in final.output].count("function_call") == len(done)


def test_text_format_json_schema_parses(client):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    response = create(
        client,
        "Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}},
        max_output_tokens=200,
    )
    assert response.status == "completed"
    assert json.loads(response.output_text)["answer"] in ("yes", "no")


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(server, body, param):
    response = httpx.post(
        f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": "Bearer key-a"}
    )
    assert response.status_code in (400, 404, 422), response.text
    assert response.json()["error"]["param"] == param


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
