"""Passing one client request to a replica, and what a failure there means.

Only a transport failure (connection refused or reset, a timeout) is the
replica's: it is marked down and the request moves to another replica, at most
`max_attempts` distinct ones. A response, whatever its status, is the answer to
this request and goes back to the client as it is: a 4xx is the client's fault,
and a 5xx may well be too (a request that trips a bug), so it is never retried
and never held against the replica; it only triggers a health check, which
decides. A stream, once started, is relayed by `streams.StreamRelay`, which
continues it elsewhere if its replica dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Mapping, Optional

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..anthropic_chat import anthropic_error_body
from ..cache.scoping import compose_salt
from ..http import BEATS, PROGRESS_HEADER, error_response
from ..http_keys import AmbiguousAuthorization, Credentials, credentials_of
from .fleet import Router
from .inbound import MESSAGES_PATH, BadRequest, ClientRequest, check_content_type, read_request
from .message_streams import MessageStreamRelay
from .policies import RouteRequest
from .progress import Stalled, has_beats, post_to, read_answer, unwrap_beats
from .replicas import Replica
from .stream_relay import StreamRelay, Upstream

logger = logging.getLogger("prefixserve.router")


def errors_for(path: str) -> Callable[..., Response]:
    """The router's own error answers in the shape of the API asked: Anthropic's body on /v1/messages (its
    clients read no other), OpenAI's elsewhere; called as http.error_response is."""
    if not path.startswith(MESSAGES_PATH):
        return error_response

    def anthropic_error(
        status: int,
        message: str,
        type_: str = "",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ) -> Response:
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)

    return anthropic_error


async def forward(router: Router, request: Request, path: str) -> Response:
    errors = errors_for(path)
    try:
        credentials = credentials_of(request.headers)
    except AmbiguousAuthorization as error:
        return errors(400, str(error), code="ambiguous_authorization")
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await request.body()  # BodySizeLimit has refused anything over --max-request-bytes
        client_request = await asyncio.to_thread(
            read_request, raw, path, router.tokenizer, router.max_prompt_tokens, router.max_prompt_chars
        )
    except BadRequest as error:
        return errors(error.status, error.message, code=error.code, param=error.param)
    cache_salt = client_request.body.get("cache_salt")
    salt = compose_salt(router.tenant_of(credentials), cache_salt if isinstance(cache_salt, str) else None)
    client_request.salt = salt
    route = await router.with_remote_run(
        router.route_request(client_request.token_ids, salt, client_request.model_name)
    )
    headers = forwarded_headers(credentials)
    version = client_request.model_version
    if version is not None and not router.serves_version(version) and any(r.healthy for r in router.replicas):
        served = ", ".join(f"fp_{v}" for v in router.model_versions()) or "none readable"
        return errors(
            404,
            f"no healthy replica serves version {version} of this model (serving: {served}); "
            "ask for the model's name alone to take any version",
            "not_found_error",
            param="model",
            code="model_not_found",
        )
    if router.settings.disaggregated and not _prefills_locally(router, client_request, route):
        await _prefill(router, path, client_request, route, headers)
    if client_request.streaming and not client_request.is_messages:
        # The relay needs token ids to continue the stream elsewhere; it strips them unless the client asked.
        raw = json.dumps({**client_request.body, "return_token_ids": True}).encode()
    return await _send_to_replicas(router, path, client_request, route, raw, headers)


# What a prefill replica is not asked for: it answers one token, whole, and that answer is dropped.
PREFILL_DROPPED_FIELDS = (
    "stream",
    "stream_options",
    "n",
    "max_completion_tokens",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)


def _prefills_locally(router: Router, client_request: ClientRequest, route: RouteRequest) -> bool:
    """Whether the decode replica the policy would pick lacks at most --local-prefill-tokens of the prompt, or every
    prefill replica has more than --max-prefill-queue-seconds of work outstanding."""
    settings = router.settings
    threshold, max_queue = settings.local_prefill_tokens, settings.max_prefill_queue_seconds
    local = max_queue is not None and all(
        r.load > max_queue for r in router.replicas if r.role == "prefill" and r.healthy
    )
    if not local and threshold:
        replica = router.choose(route, set(), version=client_request.model_version)
        local = (
            replica is not None
            and len(route.token_ids) - replica.num_hit_blocks(route) * route.tokens_per_block <= threshold
        )
    if local:
        router.metrics.prefills.labels("local").inc()
    return local


async def _prefill(
    router: Router, path: str, client_request: ClientRequest, route: RouteRequest, headers: dict
) -> None:
    """Prefill/decode disaggregation: the prompt is computed on a prefill replica first (chosen as the policy
    chooses: by its cached prefix and queue), which writes its KV to the remote tier before it answers (--role
    prefill); the decode replica chosen next fetches only what it lacks. One token, not streamed, the answer
    dropped. Best effort: when no prefill replica answers, the decode replica computes the prompt itself."""
    body = {key: value for key, value in client_request.body.items() if key not in PREFILL_DROPPED_FIELDS}
    raw = json.dumps({**body, "max_tokens": 1}).encode()
    tried: set[str] = set()
    while len(tried) < router.settings.max_attempts:
        replica = router.choose(route, tried, version=client_request.model_version, role="prefill")
        if replica is None:
            break
        tried.add(replica.name)
        ticket = router.record_route(replica, route, 1)
        try:
            upstream = await post_to(router.client, replica, path, raw, headers)
            try:
                content = await read_answer(upstream, replica.went_down, router.progress)
            finally:
                await upstream.aclose()
        except (httpx.TransportError, Stalled) as failure:
            router.fail_over(replica, failure, f"prefilling on {path}")
            continue
        finally:
            router.release(replica, ticket)
        try:
            status = unwrap_beats(content)[0] if has_beats(upstream.headers) else upstream.status_code
        except ValueError:  # an answer the router cannot read: the decode replica computes the prompt
            router.check_soon(replica)
            status = 502
        # a refusal is the request's (the decode replica answers it the same way)
        router.metrics.prefills.labels("done" if status == 200 else "refused").inc()
        return
    router.metrics.prefills.labels("skipped").inc()


async def _send_to_replicas(
    router: Router, path: str, client_request: ClientRequest, route: RouteRequest, raw: bytes, headers: dict
) -> Response:
    """The request to one replica after another, at most `max_attempts` distinct ones, until one answers: its
    stream relayed (streams.StreamRelay), or its complete answer as it is."""
    version, errors = client_request.model_version, errors_for(path)
    tried: set[str] = set()
    while len(tried) < router.settings.max_attempts:
        replica = router.choose(route, tried, version=version, cache_key=client_request.cache_key)
        if replica is None:
            break
        tried.add(replica.name)
        ticket = router.record_route(replica, route, client_request.max_tokens)
        try:
            upstream = await post_to(router.client, replica, path, raw, headers)  # a hung replica's requests move
        except (httpx.TransportError, Stalled) as failure:
            router.release(replica, ticket)
            router.fail_over(replica, failure, f"on {path}")
            continue
        if client_request.streaming and upstream.status_code == 200:
            first = Upstream(replica, upstream, ticket)
            relay = (
                MessageStreamRelay(router, client_request, route, raw, headers, tried, first)
                if client_request.is_messages
                else StreamRelay(router, client_request, headers, tried, first)
            )
            return StreamingResponse(
                relay.events(),
                media_type="text/event-stream",
                headers={
                    **passthrough_headers(upstream.headers, replica),
                    "cache-control": "no-cache",
                    "x-accel-buffering": "no",
                },
            )
        try:
            content = await read_answer(upstream, replica.went_down, router.progress)
        except (httpx.TransportError, Stalled) as failure:  # died or hung while answering: the request moves
            router.fail_over(replica, failure, f"reading the answer on {path}")
            continue
        finally:
            await upstream.aclose()
            router.release(replica, ticket)
        if not has_beats(upstream.headers):
            return relay_response(router, replica, upstream.status_code, upstream.headers, content, errors)
        try:
            status, answer_headers, content = unwrap_beats(content)
        except ValueError as error:
            router.check_soon(replica)
            return errors(
                502,
                f"replica {replica.name} sent an answer the router cannot read ({error}); retry the request",
                "server_error",
                code="bad_replica_answer",
            )
        return relay_response(router, replica, status, answer_headers, content, errors)
    if not tried:
        return errors(
            503,
            "no healthy replica can take the request; retry shortly",
            "server_error",
            code="no_replica",
            headers={"Retry-After": "1"},
        )
    return errors(
        502,
        f"the request failed on {len(tried)} replica(s) that stopped answering; retry shortly",
        "server_error",
        code="replicas_failed",
        headers={"Retry-After": "1"},
    )


async def ask_any_replica(router: Router, request: Request, path: str) -> Response:
    """A request that needs no placement (the model list, a token count, /tokenize): the first healthy replica's
    answer, the client's key and body passed on as they are."""
    errors = errors_for(path)
    try:
        credentials = credentials_of(request.headers)
    except AmbiguousAuthorization as error:
        return errors(400, str(error), code="ambiguous_authorization")
    headers = credentials.headers()
    content = None
    if request.method == "POST":
        content = await request.body()  # BodySizeLimit has refused anything over --max-request-bytes
        headers["content-type"] = request.headers.get("content-type", "application/json")
    for replica in router.replicas:
        if not replica.healthy:
            continue
        try:
            response = await router.client.request(
                request.method,
                replica.url + path,
                content=content,
                headers=headers,
                timeout=router.settings.control_timeout,
            )
        except httpx.TransportError as failure:
            router.fail_over(replica, failure, f"on {path}")
            continue
        return relay_response(router, replica, response.status_code, response.headers, response.content, errors)
    return errors(
        503, "no healthy replica; retry shortly", "server_error", code="no_replica", headers={"Retry-After": "1"}
    )


def forwarded_headers(credentials: Credentials) -> dict:
    """What a replica gets of the client's headers: its one Authorization and its one x-api-key, byte for byte
    (a header httpx could not encode as text would otherwise fail the request here), and the JSON content type;
    and the router's own request for progress beats (progress.py)."""
    return {"content-type": "application/json", PROGRESS_HEADER: BEATS, **credentials.headers()}


def relay_response(
    router: Router,
    replica: Replica,
    status: int,
    headers: Mapping[str, str],
    content: bytes,
    errors: Callable[..., Response] = error_response,
) -> Response:
    """A replica's complete answer, as it is. A 5xx makes the router check the replica's health, nothing more."""
    if status >= 500:
        router.check_soon(replica)
    media_type = headers.get("content-type", "")
    if status >= 400 and "json" not in media_type:  # never hand a client a plain-text error
        message = content.decode("utf-8", "replace")[:500] or f"replica {replica.name} answered {status}"
        return errors(
            status,
            message,
            "server_error" if status >= 500 else "invalid_request_error",
            headers=passthrough_headers(headers, replica),
        )
    return Response(
        content, status_code=status, media_type=media_type or None, headers=passthrough_headers(headers, replica)
    )


def passthrough_headers(headers: Mapping[str, str], replica: Replica) -> dict:
    kept = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
    kept["x-prefixserve-replica"] = replica.name  # a name, never the internal URL
    return kept
