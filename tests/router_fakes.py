"""A scriptable stand-in for `prefixserve serve`, and live uvicorn apps on 127.0.0.1, for router tests.

The fake speaks the replica contract the router relies on: `return_token_ids`
(token ids in every chunk, prompt ids in a choice's first chunk), seeded output
keyed by absolute position (token at position p is WORDS[(p + seed) % len]),
error events, /health, the admin-key control calls, and model versions as the
server names and checks them (system_fingerprint "fp_" + 16 hex digits; a body's
'name@fp_...' pin refused with 404 model_not_found on another version). A test tells it how to
fail: reset the connection, end without [DONE], report engine_dead or the
request's own failure, after a given number of output tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Optional

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_helpers import free_port

from prefixserve.http import BEATS, PROGRESS_HEADER, split_model
from prefixserve.http_protocol import HEADER_TIMEOUT_SECONDS, uvicorn_config
from prefixserve.model.tokenizers.tokenizer import IncrementalDecoder
from prefixserve.router.app import RouterSettings, build_router_app

ADMIN_KEY = "admin-key"
FAKE_FINGERPRINT = "fa4e" * 16  # the version a fake serves unless told otherwise
WORDS_TEXT = " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"


class LiveApp:
    """Any ASGI app served by uvicorn in a thread on a free localhost port."""

    def __init__(self, app, port: Optional[int] = None, header_timeout: float = HEADER_TIMEOUT_SECONDS) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, "critical", header_timeout))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveApp":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("app did not start within 20 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class Failure:
    how: str  # reset | truncate | engine_dead | request_failed | status_500 | stall (a stream hangs, its
    # connection open) | stall_plain (a plain request is never answered) | beats_then_stall (a replica that
    # sends progress beats, as prefixserve serve does when the router asks, then hangs before any token)
    after_tokens: int = 0


@dataclass
class FakeReplica:
    tokenizer: object
    failure: Optional[Failure] = None  # applies to every generation request while set
    engine_dead: bool = False
    requests: list = field(default_factory=list)  # (path, body, authorization) of generation requests
    control_auth: list = field(default_factory=list)  # (path, authorization) of control calls
    model_fingerprint: str = FAKE_FINGERPRINT  # what /v1/cache/info says it serves (a rolling deploy changes it)
    # A reload landing right after the next /v1/cache/info answer: the version it serves from then on.
    reload_after_info: Optional[str] = None
    num_health_checks: int = 0  # /health calls answered: a test waits on it instead of sleeping
    api_keys: list = field(default_factory=list)  # the x-api-key header of each /v1/messages request

    def __post_init__(self) -> None:
        self.words = self.tokenizer.encode(WORDS_TEXT, add_special_tokens=False)
        self.app = self._build()

    def token_at(self, position: int, seed: int) -> int:
        return self.words[(position + seed) % len(self.words)]

    def reference(self, prompt_ids: list[int], max_tokens: int, seed: int = 0) -> tuple[list[int], str]:
        """What an unbroken replica produces: (output ids, text)."""
        ids = [self.token_at(len(prompt_ids) + i, seed) for i in range(max_tokens)]
        return ids, self.tokenizer.decode(ids)

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        if path.endswith("chat/completions"):
            return self.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in body["messages"]])
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def _build(self) -> FastAPI:
        app = FastAPI()

        def control(request: Request) -> Optional[JSONResponse]:
            self.control_auth.append((request.url.path, request.headers.get("authorization")))
            if request.headers.get("authorization") != f"Bearer {ADMIN_KEY}":
                return JSONResponse(
                    {
                        "error": {
                            "message": "admin key needed",
                            "type": "permission_error",
                            "param": None,
                            "code": "forbidden",
                        }
                    },
                    status_code=403,
                )
            return None

        @app.get("/health")
        async def health():
            self.num_health_checks += 1
            if self.engine_dead:
                return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
            return {"status": "ok"}

        @app.get("/v1/cache/info")
        async def info(request: Request):
            refused = control(request)
            if refused is not None:
                return refused
            fingerprint = self.model_fingerprint
            if self.reload_after_info is not None:
                self.model_fingerprint, self.reload_after_info = self.reload_after_info, None
            return {
                "model_fingerprint": fingerprint,
                "tokenizer_fingerprint": self.tokenizer.fingerprint,
                "adapter_id": "",
                "block_size": 16,
                "prefix_hash": "sha256",
                "shared_prefixes": [],
                "max_model_len": 4096,
                "served_model_name": "fake",
            }

        @app.get("/v1/kv_events")
        async def kv_events(request: Request, since: int = 0):
            return control(request) or {"events": [], "next": since, "complete": True}

        @app.get("/v1/cache/keys")
        async def cache_keys(request: Request):
            return control(request) or {"keys": [], "next": 0}

        async def generate(request: Request, path: str):
            body = json.loads(await request.body())
            self.requests.append((path, body, request.headers.get("authorization")))
            max_tokens = body.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
                return JSONResponse(
                    {
                        "error": {
                            "message": "max_tokens: must be an integer from 1 to 4096",
                            "type": "invalid_request_error",
                            "param": "max_tokens",
                            "code": "invalid_value",
                        }
                    },
                    status_code=422,
                )
            if self.failure is not None and self.failure.how == "status_500":
                return JSONResponse(
                    {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}, status_code=500
                )
            version = split_model(body["model"])[1] if isinstance(body.get("model"), str) else None
            if version is not None and not self.model_fingerprint.startswith(version):
                return JSONResponse(
                    {
                        "error": {
                            "message": f"this replica serves version fp_{self.model_fingerprint[:16]}, not {version}",
                            "type": "not_found_error",
                            "param": "model",
                            "code": "model_not_found",
                        }
                    },
                    status_code=404,
                )
            prompt_ids = self.prompt_ids(path, body)
            if (
                self.failure is not None
                and self.failure.how == "beats_then_stall"
                and request.headers.get(PROGRESS_HEADER) == BEATS
            ):
                beat = ": beat\n\n" if body.get("stream") is True else " "
                return StreamingResponse(
                    self._beats_then_stall(beat),
                    headers={PROGRESS_HEADER: BEATS},
                    media_type="text/event-stream" if body.get("stream") else "application/json",
                )
            if body.get("stream") is True:
                return StreamingResponse(
                    self._stream(path, body, prompt_ids, max_tokens), media_type="text/event-stream"
                )
            if self.failure is not None and self.failure.how == "reset":
                return StreamingResponse(self._reset_now(), media_type="application/json")
            if self.failure is not None and self.failure.how == "stall_plain":
                await asyncio.Event().wait()  # hung: never answers
            ids, text = self.reference(prompt_ids, max_tokens, body.get("seed") or 0)
            choice = {"index": 0, "finish_reason": "length", "text": text}
            if path.endswith("chat/completions"):
                choice = {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": text}}
            return {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 1,
                "model": "fake",
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)},
            }

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await generate(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await generate(request, "/v1/chat/completions")

        @app.post("/v1/messages")
        async def messages(request: Request):
            body = json.loads(await request.body())
            self.requests.append(("/v1/messages", body, request.headers.get("authorization")))
            self.api_keys.append(request.headers.get("x-api-key"))
            prompt_ids = self.tokenizer.encode(body["messages"][-1]["content"])
            ids, text = self.reference(prompt_ids, body["max_tokens"])
            if (
                self.failure is not None
                and self.failure.how == "beats_then_stall"
                and request.headers.get(PROGRESS_HEADER) == BEATS
            ):
                return StreamingResponse(
                    self._beats_then_stall(": beat\n\n"),
                    headers={PROGRESS_HEADER: BEATS},
                    media_type="text/event-stream",
                )
            if body.get("stream") is True:
                return StreamingResponse(self._message_events(prompt_ids, ids), media_type="text/event-stream")
            if self.failure is not None and self.failure.how == "reset":
                return StreamingResponse(self._reset_now(), media_type="application/json")
            return message_of(text, len(prompt_ids), len(ids))

        return app

    async def _message_events(self, prompt_ids: list[int], ids: list[int]):
        """Anthropic's events, one text_delta per token; the failure strikes before the `after_tokens`-th event
        (0: before message_start)."""
        events = message_events(self.tokenizer, ids, len(prompt_ids))
        for index, event in enumerate(events):
            if self.failure is not None and index == self.failure.after_tokens:
                if self.failure.how == "reset":
                    raise ConnectionResetError("fake replica dies mid-stream")
                if self.failure.how == "stall":
                    await asyncio.Event().wait()
                return  # truncate
            yield event
            await asyncio.sleep(0)

    async def _beats_then_stall(self, beat: str):
        for _ in range(3):
            yield beat
            await asyncio.sleep(0.05)
        await asyncio.Event().wait()  # hung: the connection stays open, nothing more comes
        yield ""  # pragma: no cover

    async def _reset_now(self):
        raise ConnectionResetError("fake replica drops the connection")
        yield b""  # pragma: no cover (makes this an async generator)

    async def _stream(self, path: str, body: dict, prompt_ids: list[int], max_tokens: int):
        chat = path.endswith("chat/completions")
        envelope = {
            "id": f"cmpl-{len(self.requests)}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1000 + len(self.requests),
            "model": "fake",
            "system_fingerprint": "fp_" + self.model_fingerprint[:16],
        }
        seed = body.get("seed") or 0
        n = body.get("n", 1)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        failure = self.failure

        def sse(chunk: dict) -> str:
            return f"data: {json.dumps(chunk)}\n\n"

        if chat:
            for i in range(n):
                yield sse(
                    {
                        **envelope,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "prompt_token_ids": prompt_ids,
                                "token_ids": [],
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
        decoders = [IncrementalDecoder(self.tokenizer, prompt_ids) for _ in range(n)]
        emitted = [0] * n
        for step in range(max_tokens):
            if failure is not None and step == failure.after_tokens:
                async for piece in self._fail(failure, sse):
                    yield piece
                return
            for i in range(n):
                token = self.token_at(len(prompt_ids) + step, seed)
                decoders[i].push([token])
                finish = "length" if step == max_tokens - 1 else None
                full = decoders[i].text
                hits = [full.find(s) for s in stop if s in full]
                if hits:
                    full, finish = full[: min(hits)], "stop"
                # Like the real server: hold back what could be the start of a stop string.
                visible = len(full) if finish or not stop else max(emitted[i], len(full) - max(map(len, stop)) + 1)
                text, emitted[i] = full[emitted[i] : visible], max(emitted[i], visible)
                choice = {"index": i, "token_ids": [token], "logprobs": None, "finish_reason": finish}
                choice.update({"delta": {"content": text} if text else {}} if chat else {"text": text})
                if step == 0 and not chat:
                    choice["prompt_token_ids"] = prompt_ids
                yield sse({**envelope, "choices": [choice]})
                if finish == "stop":
                    break
            else:
                await asyncio.sleep(0)
                continue
            break
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            yield sse(
                {
                    **envelope,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(prompt_ids),
                        "completion_tokens": n * (step + 1),
                        "total_tokens": len(prompt_ids) + n * (step + 1),
                        "prompt_tokens_details": {"cached_tokens": 3},
                    },
                }
            )
        yield "data: [DONE]\n\n"

    async def _fail(self, failure: Failure, sse):
        if failure.how == "reset":
            raise ConnectionResetError("fake replica dies mid-stream")
        if failure.how == "engine_dead":
            self.engine_dead = True
            yield sse(
                {"error": {"message": "the engine died", "type": "server_error", "param": None, "code": "engine_dead"}}
            )
            yield "data: [DONE]\n\n"
        elif failure.how == "request_failed":
            yield sse(
                {
                    "error": {
                        "message": "this request failed",
                        "type": "server_error",
                        "param": None,
                        "code": "request_failed",
                    }
                }
            )
            yield "data: [DONE]\n\n"
        elif failure.how == "stall":  # a hung replica: the connection stays open, nothing more comes
            await asyncio.Event().wait()
            yield ""  # pragma: no cover
        # truncate: the stream just ends, without [DONE]


def message_of(text: str, input_tokens: int, output_tokens: int) -> dict:
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "fake",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def message_events(tokenizer, ids: list[int], input_tokens: int) -> list[str]:
    """A Messages stream as a replica writes it: message_start, a text block of one delta per token, the end."""

    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    start = message_of("", input_tokens, 0)
    events = [
        event("message_start", {"message": {**start, "content": [], "stop_reason": None}}),
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ]
    events += [
        event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": tokenizer.decode([token])}})
        for token in ids
    ]
    events += [
        event("content_block_stop", {"index": 0}),
        event(
            "message_delta",
            {"delta": {"stop_reason": "max_tokens", "stop_sequence": None}, "usage": {"output_tokens": len(ids)}},
        ),
        event("message_stop", {}),
    ]
    return events


@contextmanager
def fake_fleet(tokenizer, num_replicas=2, names=None, fingerprints=None, **options):
    """Fake replicas behind a real router (least_loaded: the first request goes to replica-0, a retry to replica-1),
    each serving the model version `fingerprints` gives it (default: all FAKE_FINGERPRINT)."""
    options = {
        "policy": "least_loaded",
        "admin_api_key": ADMIN_KEY,
        "health_interval": 0.1,
        "sync_interval": 0.1,
        "control_timeout": 5.0,
        **options,
    }
    with ExitStack() as stack:
        fakes = [FakeReplica(tokenizer) for _ in range(num_replicas)]
        for fake, fingerprint in zip(fakes, fingerprints or ()):
            fake.model_fingerprint = fingerprint
        apps = [stack.enter_context(LiveApp(fake.app)) for fake in fakes]
        specs = [a.url if names is None else f"{name}={a.url}" for name, a in zip(names or apps, apps)]
        app = build_router_app(RouterSettings(replicas=tuple(specs), **options))
        router_app = stack.enter_context(LiveApp(app))
        router = app.state.router
        wait_until(
            lambda: all(r.healthy and r.model_fingerprint for r in router.replicas) and router.route_keys is not None
        )
        yield router_app.url, fakes, router


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


def texts_of(events, chat=False):
    if chat:
        return "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    return "".join(c["text"] for e in events for c in e["choices"])


def assert_only_down_for(router, names):
    """No replica outside `names` was ever marked down (a request's fault must never take one out)."""
    for replica in router.replicas:
        if replica.name not in names:
            assert list(replica.down_reasons) == [], (replica.name, list(replica.down_reasons))


def read_stream(response: httpx.Response) -> tuple[list[dict], bool]:
    """(the JSON events of an SSE body, whether it ended with [DONE])."""
    events, done = [], False
    for block in response.text.split("\n\n"):
        if not block.startswith("data: "):
            continue
        payload = block[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the timeout")
        time.sleep(interval)
