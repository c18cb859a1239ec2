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

Once a chunk reached the client, what goes on runs on the model version that chunk named
(system_fingerprint), never the router's record of the replica (a reload may have come since):
the body is pinned to it ('name@fp_...', refused by a replica of another version inside its
reload gate) and the replicas' versions are read again right before one is asked. Where none
serves it, the stream ends with `stream_interrupted`: a client gets one model's text or an error.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Union

import anyio
import httpx

from ..http import split_model
from .continuation import ChoiceProgress, ContinuedText, continuation_body, pinned_model, usage_of
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
            if self.version is None:
                return _error(
                    "the replica serving this stream failed and its chunks did not name the model version "
                    "(system_fingerprint) they came from, so the stream cannot be continued without risking "
                    "two models' text; retry the request",
                    "stream_interrupted",
                )
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
        # Once a chunk reached the client, what goes on must be of the version that chunk named, or the client
        # gets text of two models: the body is pinned to it (the replica refuses it on any other version), and
        # each replica's version is read again right before it is asked (a reload since the router last read
        # it). Before any chunk, the whole request is replayed on any version, as it would be placed anew.
        version = request.model_version
        if self.version is not None:
            pinned = pinned_model(request.body.get("model"), self.envelope.get("model"), self.version)
            if pinned is None:
                return _error(
                    "the replica serving this stream failed and its chunks named no model, so the stream cannot "
                    "be pinned to its model version elsewhere; retry the request",
                    "stream_interrupted",
                )
            body["model"], version = pinned, split_model(pinned)[1]
        route = await self.router.with_remote_run(
            self.router.route_request(prompt_ids, request.salt, request.model_name)
        )
        max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else request.max_tokens
        pin_refused = False  # a replica reloaded between the read and the request refused the pin
        while len(self.tried) < self.router.settings.max_attempts:
            if self.version is not None:  # what each may be asked serves now, not at the router's last refresh
                await self.router.read_model_fingerprints(self.tried)
            replica = self.router.choose(route, self.tried, version=version)
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
                error = await self._error_of(replica, response, ticket)
                if response.status_code == 404 and error.get("code") == "model_not_found" and self.version is not None:
                    replica.model_fingerprint = None  # read anew by the health loop
                    pin_refused = True
                    continue
                return _refused(replica, response.status_code, error)
            self.router.metrics.continued.labels(replica.name).inc()
            logger.info(
                "stream continues on replica %s after %d output tokens", replica.name, len(progress.output_token_ids)
            )
            return Upstream(replica, response, ticket)
        if self.version is not None and (
            pin_refused
            or (
                len(self.tried) < self.router.settings.max_attempts
                and any(r.healthy and r.name not in self.tried for r in self.router.replicas)
            )
        ):
            return _error(
                "the replica serving this stream failed and no healthy replica serves the model version it "
                f"began on (fp_{version}; a reload or a rolling deploy?), so it cannot be continued without "
                "mixing two models' text; retry the request",
                "stream_interrupted",
            )
        return _error(
            f"the replica serving this stream failed and no other healthy replica could continue it "
            f"(tried {len(self.tried)}); retry the request",
            "no_replica",
        )

    async def _error_of(self, replica: Replica, response: httpx.Response, ticket: int) -> dict:
        """The error body of an answer other than a stream ({} when unreadable); the replica released."""
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
        return error if isinstance(error, dict) else {}


def _refused(replica: Replica, status: int, error: dict) -> Ending:
    """The continuation got an answer other than a stream: end with its error."""
    return _error(
        f"the stream's replica failed and continuing it on {replica.name} was refused "
        f"({status}: {error.get('message') or 'no message'}); retry the request",
        "stream_interrupted",
    )
