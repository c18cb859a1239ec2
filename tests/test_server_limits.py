"""Requests that can never fit are refused at once with a 4xx, never spun on; tenant ids cannot collide."""

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer

from prefixserve.cache.scoping import compose_salt
from prefixserve.http_keys import KeyTable, load_api_keys


@pytest.fixture(scope="module")
def small_pool():
    # 16 MiB holds 64 blocks x 16 tokens of the built-in model in fp32: max_model_len is capped to 1,024.
    with LiveServer("--kv-cache-memory-bytes", "16777216") as live:
        yield live


def test_max_model_len_is_capped_to_the_pool(small_pool):
    assert small_pool.engine.engine.max_model_len == 1024


def test_prompt_and_max_tokens_that_can_never_fit_are_400(small_pool):
    response = httpx.post(
        small_pool.url + "/v1/completions", timeout=30, json={"prompt": [7] * 900, "max_tokens": 2000}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    too_long = httpx.post(small_pool.url + "/v1/completions", timeout=30, json={"prompt": [7] * 2000})
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "context_length_exceeded"
    small = httpx.post(small_pool.url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3, 4], "max_tokens": 4})
    assert small.status_code == 200


def test_offline_and_http_refuse_a_prompt_that_does_not_fit_alike(small_pool):
    from prefixserve import SamplingParams
    from prefixserve.engine.limits import ContextLengthError, PromptTooLongError

    engine = small_pool.engine.engine  # the same engine, called as LLM.generate calls it
    for prompt, max_tokens, status, error in (
        ([7] * 900, 2000, 400, ContextLengthError),
        ([7] * 2000, 4, 413, PromptTooLongError),
    ):
        response = httpx.post(
            small_pool.url + "/v1/completions", timeout=30, json={"prompt": prompt, "max_tokens": max_tokens}
        )
        assert response.status_code == status, response.text
        with pytest.raises(error) as offline:
            engine.make_request(prompt, SamplingParams(max_tokens=max_tokens))
        assert response.json()["error"]["message"] == str(offline.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_k", -2),
        ("n", 17),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("logprobs", 21),
        ("cache_ttl", 0.0),
        ("cache_salt", "s" * 257),
        ("cache_salt", ""),
    ],
)
def test_one_table_of_limits_refuses_the_same_values_offline_and_over_http(small_pool, field, value):
    from prefixserve import SamplingParams

    response = httpx.post(
        small_pool.url + "/v1/completions", timeout=30, json={"prompt": [1, 2, 3], "max_tokens": 2, field: value}
    )
    assert response.status_code in (400, 422), response.text
    engine = small_pool.engine.engine
    with pytest.raises(ValueError, match="cache_salt|ttl|" + field):
        if field == "cache_salt":
            engine.make_request([1, 2, 3], SamplingParams(max_tokens=2), cache_salt=value)
        elif field == "cache_ttl":
            engine.make_request([1, 2, 3], SamplingParams(max_tokens=2), prefix_ttl=value)
        else:
            SamplingParams(**{field: value})


def test_without_max_tokens_the_answer_fits_the_room_left(small_pool):
    response = httpx.post(
        small_pool.url + "/v1/completions",
        timeout=120,
        json={"prompt": [7] * 1000, "ignore_eos": True, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 1024
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_tenant_ids_with_control_characters_are_refused(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "acme", "k2": "acme\u0000eu"}))
    with pytest.raises(SystemExit, match="control characters"):
        load_api_keys(str(keys))


def test_tenant_and_salt_never_compose_to_another_pair():
    assert compose_salt("acme", "eu") != compose_salt("acme\x00eu", None)
    assert compose_salt(None, "acme") != compose_salt("acme", None)
    assert compose_salt(None, None) is None


@settings(max_examples=300, deadline=None)
@given(
    st.tuples(st.none() | st.text(max_size=6), st.none() | st.text(max_size=6)),
    st.tuples(st.none() | st.text(max_size=6), st.none() | st.text(max_size=6)),
)
def test_compose_salt_is_injective(first, second):
    def normal(pair):  # an empty cache_salt means none
        return pair[0], pair[1] or None

    if normal(first) != normal(second):
        assert compose_salt(*first) != compose_salt(*second)


def test_key_table_finds_only_exact_keys():
    table = KeyTable({"key-a": "tenant-a", "key-b": "tenant-b"})
    assert table.lookup("key-a") == "tenant-a" and table.lookup("key-b") == "tenant-b"
    assert table.lookup("key-") is None and table.lookup("key-ab") is None and table.lookup("") is None
    assert table.lookup("\udcff") is None  # a lone surrogate cannot crash the lookup


def _asgi_app_reading_its_body():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def echo(request):
        return JSONResponse({"bytes": len(await request.body())})

    return Starlette(routes=[Route("/", echo, methods=["POST"])])


def _call(middleware, messages):
    """Run one POST through the ASGI middleware; `messages` are what receive() returns in turn (None:
    receive never returns). Returns what was sent."""
    import asyncio

    sent = []

    async def run():
        queue = list(messages)

        async def receive():
            if not queue or queue[0] is None:
                await asyncio.Event().wait()  # a client that sends nothing more
            return queue.pop(0)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/",
            "headers": [(b"content-length", b"100")],
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "server": ("127.0.0.1", 1),
        }
        await asyncio.wait_for(middleware(scope, receive, send), 10)

    asyncio.run(run())
    return sent


def test_a_stalled_body_is_a_408_and_a_client_gone_mid_upload_logs_nothing(caplog):
    from prefixserve.http_body import BodySizeLimit

    middleware = _asgi_app_reading_its_body()
    middleware.add_middleware(BodySizeLimit, max_bytes=1000, body_timeout=0.2)  # as the server and router add it
    stalled = _call(middleware, [{"type": "http.request", "body": b"x" * 10, "more_body": True}, None])
    assert stalled[0]["status"] == 408 and b"request_timeout" in stalled[1]["body"]
    with caplog.at_level("DEBUG"):
        gone = _call(
            middleware, [{"type": "http.request", "body": b"x" * 10, "more_body": True}, {"type": "http.disconnect"}]
        )
    assert gone == []  # nobody to answer
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]
    whole = _call(
        middleware,
        [
            {"type": "http.request", "body": b"x" * 10, "more_body": True},
            {"type": "http.request", "body": b"y" * 5, "more_body": False},
        ],
    )
    assert whole[0]["status"] == 200 and b'"bytes":15' in whole[1]["body"]
