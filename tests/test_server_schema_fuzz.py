"""A fuzz of JSON schemas over the three APIs: every request is answered 200 or a 4xx naming the schema (never a
5xx), and every finished (not cut) output parses and follows its schema: the promise that a finished output
always parses holds for every schema the server accepts. Schemas from a fixed seed, recursion included (some
with a way out, some without: those are refused)."""

import json
import random

import httpx
import jsonschema
import pytest
from server_helpers import LiveServer

NUM_SCHEMAS = 30


def schema_of(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "null"] + (
        ["array", "object", "anyOf", "ref"] if depth < 3 else []
    )
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None], rng.randint(1, 3))}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        return {"type": "array", "items": schema_of(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": 3}
    if kind == "anyOf":
        return {"anyOf": [schema_of(rng, depth + 1), schema_of(rng, depth + 1)]}
    if kind == "ref":
        return {"$ref": "#"}  # back to the root: finite only if some way around it is open
    names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {name: schema_of(rng, depth + 1) for name in names},
        "required": [name for name in names if rng.random() < 0.6],
    }


def roots(count: int) -> list[dict]:
    rng = random.Random(20261207)
    found = []
    while len(found) < count:
        schema = schema_of(rng)
        if schema.get("type") == "object":  # a JSON object at the root, as the APIs' formats expect
            found.append(schema)
    return found


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


SCHEMA_FIELDS = {"chat": "response_format", "responses": "text.format", "messages": "output_config"}


def ask(server, api: str, schema: dict) -> tuple[int, str, bool]:
    """(status, output text, finished) of one request whose output must follow `schema`; a refusal must name
    the schema's field as that API spells it."""
    if api == "chat":
        body = {
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 160,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        if response.status_code != 200:
            assert response.json()["error"]["param"] == SCHEMA_FIELDS[api], response.text
            return response.status_code, "", False
        choice = response.json()["choices"][0]
        return 200, choice["message"]["content"], choice["finish_reason"] == "stop"
    if api == "responses":
        body = {
            "input": "Answer in JSON.",
            "max_output_tokens": 160,
            "temperature": 0,
            "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
        }
        response = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
        if response.status_code != 200:
            assert response.json()["error"]["param"] == SCHEMA_FIELDS[api], response.text
            return response.status_code, "", False
        answer = response.json()
        text = "".join(part["text"] for item in answer["output"] for part in item.get("content", []))
        return 200, text, answer["status"] == "completed"
    body = {
        "model": "prefixserve-tiny",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 160,
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
        "temperature": 0,
    }
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    if response.status_code != 200:
        assert SCHEMA_FIELDS[api] in response.json()["error"]["message"], response.text
        return response.status_code, "", False
    answer = response.json()
    return 200, "".join(block["text"] for block in answer["content"]), answer["stop_reason"] == "end_turn"


def test_every_accepted_schema_gives_finished_outputs_that_follow_it(server):
    outcomes = {"followed": 0, "cut": 0, "refused": 0}
    for number, schema in enumerate(roots(NUM_SCHEMAS)):
        api = ("chat", "responses", "messages")[number % 3]
        status, text, finished = ask(server, api, schema)
        assert status < 500, (api, schema)
        if status != 200:
            assert status in (400, 422), (status, api, schema)
            outcomes["refused"] += 1
        elif finished:
            jsonschema.validate(json.loads(text), schema)
            outcomes["followed"] += 1
        else:
            outcomes["cut"] += 1
    assert outcomes["followed"] >= NUM_SCHEMAS // 2, outcomes  # the fuzz exercises finished outputs, not only cuts
