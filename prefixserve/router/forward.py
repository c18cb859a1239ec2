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
from typing import Mapping, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..cache.scoping import compose_salt
from ..http import BEATS, PROGRESS_HEADER, error_response
from ..http_keys import AmbiguousAuthorization, authorization_of, raw_header
from .fleet import Router
from .inbound import BadRequest, ClientRequest, check_content_type, read_request
from .policies import RouteRequest
from .progress import Stalled, has_beats, read_answer, unless_down, unwrap_beats
from .replicas import Replica
from .streams import StreamRelay, Upstream

logger = logging.getLogger("prefixserve.router")


async def forward(router: Router, request: Request, path: str) -> Response:
    try:
        authorization = authorization_of(request.headers)
    except AmbiguousAuthorization as error:
        return error_response(400, str(error), code="ambiguous_authorization")
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await request.body()  # BodySizeLimit has refused anything over --max-request-bytes
        client_request = await asyncio.to_thread(read_request, raw, path, router.tokenizer, router.max_prompt_tokens,
                                                 router.max_prompt_chars)
    except BadRequest as error:
        return error_response(error.status, error.message, code=error.code, param=error.param)
    cache_salt = client_request.body.get("cache_salt")
    salt = compose_salt(router.tenant_of(authorization), cache_salt if isinstance(cache_salt, str) else None)
    client_request.salt = salt
    route = await router.with_remote_run(router.route_request(client_request.token_ids, salt))
    headers = forwarded_headers(authorization)
    version = client_request.model_version
    if version is not None and not router.serves_version(version) and any(r.healthy for r in router.replicas):
        served = ", ".join(f"fp_{v}" for v in router.model_versions()) or "none readable"
        return error_response(404, f"no healthy replica serves version {version} of this model (serving: {served}); "
                                   "ask for the model's name alone to take any version", "not_found_error",
                              param="model", code="model_not_found")
    if client_request.streaming:
        # The relay needs token ids to continue the stream elsewhere; it strips them unless the client asked.
        raw = json.dumps({**client_request.body, "return_token_ids": True}).encode()
    return await _send_to_replicas(router, path, client_request, route, raw, headers)


async def _send_to_replicas(router: Router, path: str, client_request: ClientRequest, route: RouteRequest,
                            raw: bytes, headers: dict) -> Response:
    """The request to one replica after another, at most `max_attempts` distinct ones, until one answers: its
    stream relayed (streams.StreamRelay), or its complete answer as it is."""
    version = client_request.model_version
    tried: set[str] = set()
    while len(tried) < router.settings.max_attempts:
        replica = router.choose(route, tried, version=version, cache_key=client_request.cache_key)
        if replica is None:
            break
        tried.add(replica.name)
        ticket = router.record_route(replica, route, client_request.max_tokens)
        try:
            sending = router.client.send(router.client.build_request("POST", replica.url + path, content=raw,
                                                                     headers=headers), stream=True)
            upstream = await unless_down(sending, replica.went_down)  # a hung replica's requests move
        except (httpx.TransportError, Stalled) as failure:
            router.release(replica, ticket)
            router.fail_over(replica, failure, f"on {path}")
            continue
        if client_request.streaming and upstream.status_code == 200:
            relay = StreamRelay(router, client_request, headers, tried,
                                Upstream(replica, upstream, ticket, replica.model_fingerprint))
            return StreamingResponse(relay.events(), media_type="text/event-stream",
                                     headers={**passthrough_headers(upstream.headers, replica),
                                              "cache-control": "no-cache", "x-accel-buffering": "no"})
        try:
            content = await read_answer(upstream, replica.went_down, router.progress)
        except (httpx.TransportError, Stalled) as failure:  # died or hung while answering: the request moves
            router.fail_over(replica, failure, f"reading the answer on {path}")
            continue
        finally:
            await upstream.aclose()
            router.release(replica, ticket)
        if not has_beats(upstream.headers):
            return relay_response(router, replica, upstream.status_code, upstream.headers, content)
        try:
            status, answer_headers, content = unwrap_beats(content)
        except ValueError as error:
            router.check_soon(replica)
            return error_response(502, f"replica {replica.name} sent an answer the router cannot read ({error}); "
                                       "retry the request", "server_error", code="bad_replica_answer")
        return relay_response(router, replica, status, answer_headers, content)
    if not tried:
        return error_response(503, "no healthy replica can take the request; retry shortly", "server_error",
                              code="no_replica", headers={"Retry-After": "1"})
    return error_response(502, f"the request failed on {len(tried)} replica(s) that stopped answering; retry "
                               "shortly", "server_error", code="replicas_failed", headers={"Retry-After": "1"})


def forwarded_headers(authorization: Optional[str]) -> dict:
    """What a replica gets of the client's headers: its one Authorization, byte for byte (a header httpx
    could not encode as text would otherwise fail the request here), and the JSON content type; and the
    router's own request for progress beats (progress.py)."""
    headers = {"content-type": "application/json", PROGRESS_HEADER: BEATS}
    if authorization is not None:
        headers["authorization"] = raw_header(authorization)
    return headers


def relay_response(router: Router, replica: Replica, status: int, headers: Mapping[str, str],
                   content: bytes) -> Response:
    """A replica's complete answer, as it is. A 5xx makes the router check the replica's health, nothing more."""
    if status >= 500:
        router.check_soon(replica)
    media_type = headers.get("content-type", "")
    if status >= 400 and "json" not in media_type:  # never hand a client a plain-text error
        message = content.decode("utf-8", "replace")[:500] or f"replica {replica.name} answered {status}"
        return error_response(status, message, "server_error" if status >= 500 else "invalid_request_error",
                              headers=passthrough_headers(headers, replica))
    return Response(content, status_code=status, media_type=media_type or None,
                    headers=passthrough_headers(headers, replica))


def passthrough_headers(headers: Mapping[str, str], replica: Replica) -> dict:
    kept = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
    kept["x-prefixserve-replica"] = replica.name  # a name, never the internal URL
    return kept
