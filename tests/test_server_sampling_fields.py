"""Over HTTP, every sampling field changes the answer as its API documents or is refused by name: the
penalties, logit_bias, min_p, min_tokens and bad_words arrive in the engine; the fields this server does not
implement yet are a 400 naming them, never a 200 that ignored them."""

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

GREEDY = {
    "prompt": "The colour of the sky is",
    "max_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def complete(server, **fields):
    response = httpx.post(server.url + "/v1/completions", json={**GREEDY, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_logit_bias_and_penalties_change_the_answer(server):
    plain = complete(server)["token_ids"]
    assert complete(server, logit_bias={"42": 100})["token_ids"] == [42] * 6  # OpenAI's string keys
    banned = complete(server, logit_bias={str(plain[0]): -100})["token_ids"]
    assert plain[0] not in banned
    assert complete(server, frequency_penalty=0, presence_penalty=0)["token_ids"] == plain  # zero: unchanged
    assert complete(server, repetition_penalty=1.0, min_p=0.0, min_tokens=0)["token_ids"] == plain
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {"42": 100},
            "return_token_ids": True,
        },
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["token_ids"] == [42] * 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f", "parameters": {}}]),
        ("best_of", 2),
        ("use_beam_search", True),
    ],
)
def test_fields_this_server_does_not_implement_are_refused_by_name(server, field, value):
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        response = httpx.post(server.url + path, json={**body, "max_tokens": 2, field: value}, timeout=30)
        assert_openai_error(response, 400, field)
        assert response.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    "field, value",
    [("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "required")],
)
def test_completions_refuse_the_chat_tool_fields(server, field, value):
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value}, timeout=30
    )
    assert_openai_error(response, 400, field, code="unsupported_parameter")


@pytest.mark.parametrize(
    "field, value",
    [("tools", []), ("tool_choice", "none"), ("best_of", 1), ("response_format", {"type": "text"}), ("store", False)],
)
def test_their_no_op_values_pass(server, field, value):
    assert complete(server, **{field: value})["token_ids"] == complete(server)["token_ids"]


@pytest.mark.parametrize(
    "field, value, status",
    [
        ("presence_penalty", 2.5, 422),
        ("frequency_penalty", -3, 422),
        ("repetition_penalty", 0, 422),
        ("min_p", 1.5, 422),
        ("min_tokens", -1, 422),
        ("logit_bias", {"x": 1}, 400),
        ("logit_bias", {"5": 101}, 400),
        ("min_tokens", 99, 400),
        ("bad_words", [" "], 400),
        ("logit_bias", {"99999999": 1}, 400),
    ],
)
def test_bad_values_name_the_field(server, field, value, status):
    response = httpx.post(server.url + "/v1/completions", json={**GREEDY, field: value}, timeout=30)
    assert response.status_code == status, response.text
    assert field in response.text
