"""Relaying a stream, and keeping it alive when its replica dies.

The relay reads the replica's SSE events, notes per choice what reached the client
(prompt ids, output ids, text), strips the token ids it asked for unless the client
asked too, and passes the chunks on (stream_chunks.py). A stream breaks when the
transport fails, when it ends without `[DONE]`, or when the replica reports
`engine_dead`; any other error event is the request's own and is relayed as it is.
After a break:

    every choice finished   -> usage (if asked) and [DONE]
    nothing sent yet        -> replay the original request on another replica
    one choice, ids known   -> continue it there (continuation.py), same id/created/model
    otherwise               -> an OpenAI-style error event, then [DONE]; never a bare disconnect
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

import anyio
import httpx

from .continuation import ChoiceProgress, ContinuedText, continuation_body, usage_of
from .fleet import Router
from .inbound import ClientRequest
from .progress import Stalled, has_beats, post_to, unless_down
from .replicas import Replica
from .sse import DONE, SSEParser, sse, sse_error
from .stream_chunks import ClientChunks

logger = logging.getLogger("prefixserve.router")


@dataclass
class Upstream:
    replica: Replica
    response: httpx.Response
    ticket: int
    # The model version the stream began on (its first replica's, when the stream started): a continuation
    # must be of the same, or the client would get text of two models. None: unknown, any replica goes.
    model_fingerprint: Optional[str] = None


@dataclass
class Ending:
    """How a stream ends when it cannot go on upstream: these pieces, then (unless failed) usage, then DONE."""

    pieces: list[bytes]
    failed: bool = False


def _error(message: str, code: str) -> Ending:
    return Ending([sse_error(message, code)], failed=True)


@dataclass
class Outcome:
    kind: str = "broken"  # done: [DONE] reached | failed: the request's own error relayed | broken: go on elsewhere
    reason: str = "the stream ended without [DONE]"


def _has_tokens(chunk: dict) -> bool:
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("token_ids") for c in choices)


class StreamRelay(ClientChunks):
    def __init__(self, router: Router, request: ClientRequest, headers: dict, tried: set[str], first: Upstream) -> None:
        super().__init__(request)
        self.router, self.headers, self.tried = router, headers, tried
        self.upstream = first

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                outcome = Outcome()
                async with aclosing(self._relay(self.upstream, outcome)) as pieces:
                    async for piece in pieces:
                        yield piece
                if outcome.kind == "failed":
                    break
                if outcome.kind == "broken":
                    logger.info("stream on replica %s broke (%s)", self.upstream.replica.name, outcome.reason)
                    resumed = await self._resume()
                    if isinstance(resumed, Upstream):
                        self.upstream = resumed
                        continue
                    for piece in resumed.pieces:
                        yield piece
                    if resumed.failed:
                        break
                if self.include_usage and not self.usage_sent and self.envelope is not None:
                    ordered = [self.choices[i] for i in sorted(self.choices)]
                    yield sse({**self.envelope, "choices": [], "usage": usage_of(ordered, self.request.n, None)})
                break
        except Exception:  # whatever went wrong, the client gets an error event, not a cut connection
            logger.exception("stream relay failed")
            yield sse_error("the router failed while relaying this stream; retry the request", "router_error")
        yield DONE

    async def _relay(self, upstream: Upstream, outcome: Outcome) -> AsyncIterator[bytes]:
        parser = SSEParser()
        clock = self.router.progress
        chunks = upstream.response.aiter_bytes().__aiter__()
        # stepping: silence means a hang (the replica sends beats, or a token has come: each chunk is a step away)
        stepping, last = has_beats(upstream.response.headers), time.monotonic()
        try:
            while True:
                try:
                    data = await unless_down(
                        chunks.__anext__(), upstream.replica.went_down, clock.deadline if stepping else None
                    )
                except StopAsyncIteration:
                    break
                arrived = time.monotonic()
                if stepping:
                    clock.observe(arrived - last)
                last = arrived
                for payload in parser.feed(data):
                    if payload.strip() == "[DONE]":
                        outcome.kind = "done"
                        return
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        outcome.reason = "the replica sent an unreadable event"
                        return
                    if "error" in chunk:
                        error = chunk["error"]
                        if isinstance(error, dict) and error.get("code") == "engine_dead":
                            self.router.check_soon(upstream.replica)  # /health will say 503 and take it out
                            outcome.reason = "its engine died"
                            return
                        outcome.kind = "failed"  # the request's own failure: relay it, do not retry
                        yield sse(chunk)
                        return
                    stepping = stepping or _has_tokens(chunk)
                    for piece in self._pieces(chunk):
                        yield piece
                    if self.stopped_here:
                        outcome.kind = "done"
                        return
            self.router.check_soon(upstream.replica)
        except (httpx.TransportError, Stalled) as failure:
            self.router.fail_over(upstream.replica, failure, "during a stream")
            outcome.reason = repr(failure)
        finally:
            with anyio.CancelScope(shield=True):  # close the upstream even when the client went away
                await upstream.response.aclose()
            self.router.release(upstream.replica, upstream.ticket)

    # ---------------------------------------------------------------- resume
    async def _resume(self) -> Union[Upstream, Ending]:
        """Another replica's stream to go on with, or how the stream ends here."""
        request = self.request
        if (
            self.choices
            and len(self.choices) >= request.num_choices
            and all(p.finish_reason is not None for p in self.choices.values())
        ):
            return Ending([])  # only [DONE] (and usage) was lost
        if request.num_choices != 1:
            return _error(
                f"the replica serving this stream failed, and a stream of {request.num_choices} choices "
                "cannot be continued elsewhere; retry the request",
                "stream_interrupted",
            )
        progress = self.choices.setdefault(0, ChoiceProgress())
        if progress.prompt_token_ids is not None:
            if self.continued is None:
                self.continued = ContinuedText(self.router.tokenizer, progress, request.body)
            body = continuation_body(request, progress, self.include_usage)
            if body is None:  # every token asked for was produced; only the finish was lost
                return Ending(list(self._continued_pieces({"choices": [{"token_ids": [], "finish_reason": "length"}]})))
            path, prompt_ids = "/v1/completions", body["prompt"]
        elif progress.nothing_sent:
            body = {**request.body, "return_token_ids": True}
            path, prompt_ids = request.path, request.token_ids
        else:
            return _error(
                "the replica serving this stream failed and did not report its token ids, so the stream "
                "cannot be continued; retry the request",
                "stream_interrupted",
            )
        route = await self.router.with_remote_run(self.router.route_request(prompt_ids, request.salt))
        max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else request.max_tokens
        fingerprint = self.upstream.model_fingerprint
        while len(self.tried) < self.router.settings.max_attempts:
            replica = self.router.choose(route, self.tried, fingerprint, request.model_version)
            if replica is None:
                break
            self.tried.add(replica.name)
            ticket = self.router.record_route(replica, route, max_tokens)
            try:
                response = await post_to(self.router.client, replica, path, json.dumps(body).encode(), self.headers)
            except (httpx.TransportError, Stalled) as failure:
                self.router.release(replica, ticket)
                self.router.fail_over(replica, failure, "continuing a stream")
                continue
            if response.status_code != 200:
                return await self._refused(replica, response, ticket)
            self.router.metrics.continued.labels(replica.name).inc()
            logger.info(
                "stream continues on replica %s after %d output tokens", replica.name, len(progress.output_token_ids)
            )
            return Upstream(replica, response, ticket, fingerprint)
        if (
            fingerprint is not None
            and len(self.tried) < self.router.settings.max_attempts
            and any(r.healthy and r.name not in self.tried for r in self.router.replicas)
        ):
            return _error(
                "the replica serving this stream failed and no healthy replica serves the model version it "
                f"began on ({fingerprint[:12]}; a rolling deploy?), so it cannot be continued without mixing "
                "two models' text; retry the request",
                "stream_interrupted",
            )
        return _error(
            f"the replica serving this stream failed and no other healthy replica could continue it "
            f"(tried {len(self.tried)}); retry the request",
            "no_replica",
        )

    async def _refused(self, replica: Replica, response: httpx.Response, ticket: int) -> Ending:
        """The continuation got an answer other than a stream: end with its error."""
        try:
            await response.aread()
            error = response.json().get("error")
        except (httpx.HTTPError, ValueError, AttributeError):
            error = None
        finally:
            await response.aclose()
            self.router.release(replica, ticket)
        if response.status_code >= 500:
            self.router.check_soon(replica)
        message = error.get("message") if isinstance(error, dict) else None
        return _error(
            f"the stream's replica failed and continuing it on {replica.name} was refused "
            f"({response.status_code}: {message or 'no message'}); retry the request",
            "stream_interrupted",
        )
