"""OpenAI's Responses API through the router: a stored response lives on the replica that answered it, so every
request that names one goes there.

    POST /v1/responses              with a previous_response_id the router saw answered: that replica, while it
                                    is healthy; otherwise placed by the policy as a chat is (its prompt_cache_key
                                    kept, by load: the input is not tokenized here yet)
    GET | DELETE /v1/responses/ID   (and .../input_items) the replica that answered ID; one the router never saw
                                    (it restarted) is asked of each healthy replica until one does not answer 404

Owners are learnt from the answers: a body's id, a stream's response.created event; the newest `max_entries`
are kept. A stored response is its replica's alone: when that replica is gone, a request naming it gets the
404 another replica answers (the conversation must be sent again as input). A stream is relayed as it comes and
not continued elsewhere: a replica that dies mid-stream ends it with a response.failed event.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import AsyncIterator, Optional

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..http import error_response
from ..http_body import parse_json_body
from ..http_keys import AmbiguousAuthorization, credentials_of
from .fleet import Router
from .forward import forwarded_headers, passthrough_headers, relay_response
from .inbound import BadRequest, check_content_type
from .progress import Stalled, post_to, read_answer
from .replicas import Replica

RESPONSES_PATH = "/v1/responses"
DEFAULT_MAX_ENTRIES = 100_000


class ResponseOwners:
    """response id -> the name of the replica that answered it, newest `max_entries` kept."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._owners: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: object, replica: Replica) -> None:
        if isinstance(response_id, str) and response_id:
            self._owners[response_id] = replica.name
            self._owners.move_to_end(response_id)
            while len(self._owners) > self.max_entries:
                self._owners.popitem(last=False)

    def owner(self, router: Router, response_id: object) -> Optional[Replica]:
        """The healthy replica that answered `response_id`, or None."""
        name = self._owners.get(response_id) if isinstance(response_id, str) else None
        return next((r for r in router.replicas if r.name == name and r.healthy), None)


async def create_response(router: Router, owners: ResponseOwners, request: Request) -> Response:
    try:
        credentials = credentials_of(request.headers)
        check_content_type(request.headers.get("content-type"))
    except AmbiguousAuthorization as error:
        return error_response(400, str(error), code="ambiguous_authorization")
    except BadRequest as error:
        return error_response(error.status, error.message, code=error.code, param=error.param)
    raw = await request.body()  # BodySizeLimit has refused anything over --max-request-bytes
    try:
        body = await asyncio.to_thread(parse_json_body, raw)
    except ValueError as error:
        return error_response(400, str(error), code="invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object", code="invalid_json")
    owner = owners.owner(router, body.get("previous_response_id"))
    cache_key = body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None
    headers = forwarded_headers(credentials)
    tried: set[str] = set()
    while len(tried) < router.settings.max_attempts:
        replica = owner if owner is not None and not tried else router.choose(None, tried, cache_key=cache_key)
        if replica is None:
            break
        tried.add(replica.name)
        ticket = router.record_route(replica, None, None)
        try:
            upstream = await post_to(router.client, replica, RESPONSES_PATH, raw, headers)
        except (httpx.TransportError, Stalled) as failure:
            router.release(replica, ticket)
            router.fail_over(replica, failure, f"on {RESPONSES_PATH}")
            continue
        if body.get("stream") is True and upstream.status_code == 200:
            return StreamingResponse(
                _relay(router, owners, replica, ticket, upstream),
                media_type="text/event-stream",
                headers={**passthrough_headers(upstream.headers, replica), "cache-control": "no-cache"},
            )
        try:
            content = await read_answer(upstream, replica.went_down, router.progress)
        except (httpx.TransportError, Stalled) as failure:
            router.fail_over(replica, failure, f"reading the answer on {RESPONSES_PATH}")
            continue
        finally:
            await upstream.aclose()
            router.release(replica, ticket)
        if upstream.status_code == 200:
            owners.learn(_id_of(content), replica)
        return relay_response(router, replica, upstream.status_code, upstream.headers, content)
    return error_response(
        503, "no healthy replica can take the request; retry shortly", "server_error", code="no_replica"
    )


def _id_of(content: bytes) -> Optional[str]:
    try:
        answer = json.loads(content)
    except ValueError:
        return None
    return answer.get("id") if isinstance(answer, dict) else None


async def _relay(
    router: Router, owners: ResponseOwners, replica: Replica, ticket: int, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """The replica's events as they come; the first (response.created) names the response's owner."""
    pending = b""
    learnt = False
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
            if not learnt:
                pending += chunk
                for line in pending.split(b"\n"):
                    if line.startswith(b"data:") and b"response.created" in line:
                        try:
                            owners.learn(json.loads(line[5:])["response"]["id"], replica)
                        except (ValueError, KeyError, TypeError):
                            pass
                        learnt = True
                        break
                pending = b"" if learnt else pending[-65536:]
    except httpx.TransportError as failure:
        router.fail_over(replica, failure, f"streaming {RESPONSES_PATH}")
        failed = {
            "type": "response.failed",
            "response": {
                "status": "failed",
                "error": {"code": "replica_failed", "message": f"replica {replica.name} stopped answering; retry"},
            },
        }
        yield f"event: response.failed\ndata: {json.dumps(failed)}\n\n".encode()
    finally:
        await upstream.aclose()
        router.release(replica, ticket)


async def stored_response(router: Router, owners: ResponseOwners, request: Request, path: str) -> Response:
    """GET or DELETE of a stored response (or its input items): its owner, else each healthy replica in turn."""
    try:
        credentials = credentials_of(request.headers)
    except AmbiguousAuthorization as error:
        return error_response(400, str(error), code="ambiguous_authorization")
    response_id = request.path_params["response_id"]
    owner = owners.owner(router, response_id)
    replicas = [owner] if owner is not None else [r for r in router.replicas if r.healthy]
    last = None
    for replica in replicas:
        try:
            answer = await router.client.request(
                request.method,
                replica.url + path,
                headers=credentials.headers(),
                timeout=router.settings.control_timeout,
            )
        except httpx.TransportError as failure:
            router.fail_over(replica, failure, f"on {path}")
            continue
        last = (replica, answer)
        if answer.status_code != 404:
            if answer.status_code == 200 and request.method == "GET":
                owners.learn(response_id, replica)
            break
    if last is None:
        return error_response(503, "no healthy replica; retry shortly", "server_error", code="no_replica")
    replica, answer = last
    return relay_response(router, replica, answer.status_code, answer.headers, answer.content)
