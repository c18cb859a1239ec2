"""vLLM's /tokenize and /detokenize on the live server: the generation route's own tokens, both ways."""

import httpx
import pytest
from server_helpers import LiveServer


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def test_tokenize_gives_the_tokens_a_completion_is_computed_on(server):
    text = "The capital of France is"
    answer = httpx.post(server.url + "/tokenize", json={"model": "prefixserve-tiny", "prompt": text}).json()
    tokenizer = server.engine.engine.tokenizer
    assert answer["tokens"] == tokenizer.encode(text)
    assert answer["count"] == len(answer["tokens"]) and answer["token_strs"] is None
    assert answer["max_model_len"] == server.engine.engine.max_model_len
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == answer["count"]
    bare = httpx.post(
        server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert "".join(bare["token_strs"]) == text


def test_tokenize_renders_a_chat_through_its_template(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    answer = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert answer["tokens"] == server.engine.engine.tokenizer.encode_chat(messages)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == answer["count"]
    no_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert no_prompt.json()["count"] < answer["count"]


def test_detokenize_inverts_tokenize(server):
    text = "Paged KV blocks, chained keys."
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json() == {"prompt": text}


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/tokenize", {}, 422, "invalid_value"),
        ("/tokenize", {"prompt": 5}, 422, "invalid_value"),
        ("/tokenize", {"prompt": "x", "model": "another"}, 404, "model_not_found"),
        ("/detokenize", {"tokens": [-1]}, 400, "invalid_tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "invalid_tokens"),
        ("/detokenize", {"tokens": ["a"]}, 422, "invalid_value"),
    ],
)
def test_bad_bodies_are_4xx_with_an_openai_error(server, path, body, status, code):
    answer = httpx.post(server.url + path, json=body)
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
