"""Progress beats (server/beats.py): a replica shows a router it is stepping, so silence means a hang.

Beats come while the engine makes progress and stop when it is stuck; a beating answer carries the same body
as a plain one; leaving it aborts the work. Requests pinned to a model version run only on that version."""

import asyncio
import json
import time

import httpx
import pytest
from server_helpers import LiveServer, assert_openai_error

from prefixserve.http import BEATS, PROGRESS_HEADER
from prefixserve.server import beats
from prefixserve.server.beats import BODY_BEAT, beating

BEATING = {PROGRESS_HEADER: BEATS}


class FakeEngine:
    def __init__(self) -> None:
        self.num_steps = 0
        self.step_started = None


async def gated(released: asyncio.Event, item="answer"):
    await released.wait()
    yield item


async def collect_until(generator, released: asyncio.Event, num_beats: int, limit: float) -> list:
    """Items of `generator`; once `num_beats` beats came, or `limit` seconds passed, release its source."""
    items, started = [], time.monotonic()

    async def release_later():
        while len(items) < num_beats and time.monotonic() - started < limit:
            await asyncio.sleep(0.01)
        released.set()

    releaser = asyncio.create_task(release_later())
    async for item in generator:
        items.append(item)
    await releaser
    return items


def test_beats_come_while_the_engine_steps_or_is_inside_a_step(monkeypatch):
    monkeypatch.setattr(beats, "BEAT_SECONDS", 0.02)
    engine = FakeEngine()

    async def stepping():
        while True:
            engine.num_steps += 1
            await asyncio.sleep(0.005)

    async def run(long_step: bool) -> list:
        released = asyncio.Event()
        if long_step:  # one step under way for a while, none finishing: a long prefill chunk
            engine.step_started = time.monotonic()
            return await collect_until(beating(gated(released), engine, BODY_BEAT), released, 3, limit=30)
        task = asyncio.create_task(stepping())
        try:
            return await collect_until(beating(gated(released), engine, BODY_BEAT), released, 3, limit=30)
        finally:
            task.cancel()

    for long_step in (False, True):
        items = asyncio.run(run(long_step))
        assert items[:3] == [BODY_BEAT] * 3 and items[-1] == "answer"


def test_no_beats_from_an_idle_or_stuck_engine(monkeypatch):
    monkeypatch.setattr(beats, "BEAT_SECONDS", 0.02)
    engine = FakeEngine()

    async def run() -> list:
        released = asyncio.Event()
        return await collect_until(beating(gated(released), engine, BODY_BEAT), released, 1, limit=0.5)

    assert asyncio.run(run()) == ["answer"]  # no step finished, none under way
    engine.step_started = time.monotonic() - beats.STUCK_STEP_SECONDS - 1  # one step, far too long
    assert asyncio.run(run()) == ["answer"]


def test_leaving_a_beating_response_cancels_its_source(monkeypatch):
    monkeypatch.setattr(beats, "BEAT_SECONDS", 0.02)
    engine = FakeEngine()
    cancelled = []

    async def forever():
        try:
            await asyncio.Event().wait()
            yield "never"
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def run():
        generator = beating(forever(), engine, BODY_BEAT)
        engine.step_started = time.monotonic()
        assert await generator.__anext__() == BODY_BEAT
        await generator.aclose()

    asyncio.run(run())
    assert cancelled == [True]


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def answer(server, body, headers=None) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def test_a_beating_answer_holds_the_plain_answer(server, monkeypatch):
    body = {"prompt": "Beats show progress", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    plain = answer(server, body)
    monkeypatch.setattr(beats, "BEAT_SECONDS", 0.0005)  # the server runs in this process: beats between steps
    beating_answer = answer(server, body, BEATING)
    assert beating_answer.status_code == 200 and beating_answer.headers[PROGRESS_HEADER] == BEATS
    assert PROGRESS_HEADER not in plain.headers
    envelope = json.loads(beating_answer.content)  # beats are leading whitespace
    assert beating_answer.content.startswith(BODY_BEAT) and beating_answer.content.lstrip(b" ").startswith(b"{")
    assert envelope["status"] == 200
    assert envelope["body"]["choices"] == plain.json()["choices"]
    assert envelope["body"]["usage"]["completion_tokens"] == 64


def test_a_beating_stream_is_the_plain_stream_with_comments(server, monkeypatch):
    body = {"prompt": "Beats show progress", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}

    def data_lines(headers):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line]
            return response.headers, [line for line in lines if not line.startswith(":")], lines

    headers, plain, _ = data_lines({})
    monkeypatch.setattr(beats, "BEAT_SECONDS", 0.0005)
    beat_headers, beating_lines, raw = data_lines(BEATING)
    assert beat_headers[PROGRESS_HEADER] == BEATS and PROGRESS_HEADER not in headers
    comments = [line for line in raw if line.startswith(":")]
    assert comments and set(comments) == {": beat"}
    texts = [
        [json.loads(line[6:])["choices"] for line in lines if line != "data: [DONE]"]
        for lines in (plain, beating_lines)
    ]
    assert texts[0] == texts[1] and beating_lines[-1] == "data: [DONE]"


def test_errors_before_the_work_starts_are_plain_4xx(server):
    response = answer(server, {"prompt": "x", "max_tokens": -1}, BEATING)
    assert PROGRESS_HEADER not in response.headers
    assert_openai_error(response, 422)


def test_a_request_pinned_to_a_model_version(server):
    fingerprint = server.engine.engine.scope.model_fingerprint
    name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"prompt": "pinned", "max_tokens": 2}
    served = answer(server, {**body, "model": f"{name}@fp_{fingerprint[:16]}"})
    assert served.status_code == 200, served.text
    assert served.json()["system_fingerprint"] == f"fp_{fingerprint[:16]}"
    assert answer(server, {**body, "model": f"{name}@{fingerprint[:8].upper()}"}).status_code == 200
    other = "0" * 16 if not fingerprint.startswith("0" * 16) else "f" * 16
    assert_openai_error(
        answer(server, {**body, "model": f"{name}@fp_{other}"}), 404, param="model", code="model_not_found"
    )
    for malformed in (f"{name}@", f"{name}@fp_12", f"{name}@xyz123"):
        assert_openai_error(answer(server, {**body, "model": malformed}), 400, param="model", code="invalid_value")
    assert_openai_error(answer(server, {**body, "model": f"other@fp_{fingerprint[:16]}"}), 404, code="model_not_found")
