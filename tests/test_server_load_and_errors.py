"""Concurrency, backpressure, disconnects and bad input against the live server."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


async def stream_text(client, url, prompt, max_tokens=8):
    body = {
        "model": "prefixserve-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, done = "", False
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            text += json.loads(line[6:])["choices"][0]["text"]
    assert done
    return text


def test_32_concurrent_streams_all_complete_correctly(server):
    prompts = [f"Request number {i} asks about caching" for i in range(32)]
    expected = {
        p: httpx.post(
            server.url + "/v1/completions",
            json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).json()["choices"][0]["text"]
        for p in prompts[:4]
    }

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(stream_text(client, server.url, p) for p in prompts))

    texts = asyncio.run(run())
    assert len(texts) == 32 and all(texts)
    for prompt, text in zip(prompts, texts):
        if prompt in expected:
            assert text == expected[prompt]
    server.wait_idle()


def test_queue_limit_answers_429_with_retry_after():
    # The engine thread is held between steps, so every accepted request stays waiting: with a queue
    # of 8, exactly 8 of 12 simultaneous requests are queued and 4 get 429, however fast the machine.
    with LiveServer("--max-num-seqs", "4", "--max-waiting", "8") as server:
        with held_engine(server):
            responses = asyncio.run(send_concurrently(server, 12))
            rejected = [r for r in responses if r is not None]
        codes = [r.status_code for r in rejected]
        assert codes == [429] * 4
        assert rejected[0].headers["retry-after"] == "1"
        assert rejected[0].json()["error"]["code"] == "queue_full"
        server.wait_idle(timeout=60)


class held_engine:
    """Runs a call on the engine thread that waits until the block exits: no step runs meanwhile."""

    def __init__(self, server) -> None:
        self.server, self.entered, self.release = server, threading.Event(), threading.Event()

    def __enter__(self):
        def hold(_core):
            self.entered.set()
            self.release.wait(timeout=60)

        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.engine.call(hold)), daemon=True)
        self.thread.start()
        assert self.entered.wait(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.join(timeout=30)


async def send_concurrently(server, count):
    """Sends `count` requests; returns the responses that came back while the engine is held (the refusals)."""
    body = {"prompt": "Fill the queue " * 20, "max_tokens": 4, "ignore_eos": True}
    client = httpx.AsyncClient(timeout=120)
    tasks = [asyncio.create_task(client.post(server.url + "/v1/completions", json=body)) for _ in range(count)]
    deadline = time.monotonic() + 30
    while sum(task.done() for task in tasks) + server.engine.num_waiting < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    refused = [task.result() if task.done() else None for task in tasks]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    return refused


def test_disconnect_mid_stream_frees_blocks(server):
    server.wait_idle()
    baseline = server.engine.engine.cache.usage().num_referenced_blocks
    body = {"prompt": "A long answer please " * 10, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # got the first chunk, now hang up
    deadline = time.monotonic() + 10
    while server.engine.engine.cache.usage().num_referenced_blocks != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.engine.cache.usage().num_referenced_blocks == baseline
    assert not server.engine.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"prompt": 5}, 422, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 422, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 7}, 422, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, 422, "n"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "word " * 5000}, 413, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 422, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, None),
    ],
)
def test_bad_input_gets_status_and_openai_error_body(server, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + path, timeout=30, **kwargs)
    assert_openai_error(response, status, param)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_extra_fields_are_ignored(server):
    response = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2, "frequency_penalty": 0, "whatever": {"a": 1}},
        timeout=30,
    )
    assert response.status_code == 200
