"""OpenAI's Responses API through the router: a stored response lives on the replica that answered it, so every
request that names one goes there; and the router keeps each conversation, so it survives that replica.

    POST /v1/responses              with a previous_response_id the router saw answered: that replica, while it
                                    is healthy (its cache holds the conversation); when it is gone, any replica,
                                    the request rewritten to carry the whole conversation as input (slower: that
                                    replica prefills what it lacks); otherwise placed by the policy as a chat is
                                    (its prompt_cache_key kept, by load: the input is not tokenized here yet)
    GET | DELETE /v1/responses/ID   (and .../input_items) the replica that answered ID; one the router never saw
                                    (it restarted) is asked of each healthy replica until one does not answer 404

The ledger learns from the answers (a body, a stream's response.created and closing events): which replica
answered each stored response, its tenant (the router's keys, as the replicas'), the response it continued, its
input items and its output items (a reasoning item left out: no replica takes one back). The newest
`max_entries` are kept; a conversation whose older turns left the ledger cannot be rebuilt, and a request naming
it gets the 404 a replica answers. A stream is relayed as it comes and not continued elsewhere: a replica that
dies mid-stream ends it with a response.failed event.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
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


@dataclass
class Turn:
    """One stored response as the router saw it."""

    replica: str
    tenant: Optional[str]
    previous: Optional[str]  # the response it continued
    input_items: list
    output_items: list = field(default_factory=list)


class ResponseLedger:
    """response id -> its Turn, newest `max_entries` kept."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._turns: OrderedDict[str, Turn] = OrderedDict()

    def learn(self, response_id: object, turn: Turn) -> None:
        if isinstance(response_id, str) and response_id:
            self._turns[response_id] = turn
            self._turns.move_to_end(response_id)
            while len(self._turns) > self.max_entries:
                self._turns.popitem(last=False)

    def answered(self, response_id: object, output: object) -> None:
        """A response's output items, once it finished."""
        turn = self._turns.get(response_id) if isinstance(response_id, str) else None
        if turn is not None and isinstance(output, list):
            turn.output_items = [item for item in output if isinstance(item, dict) and item.get("type") != "reasoning"]

    def owner(self, router: Router, response_id: object) -> Optional[Replica]:
        """The healthy replica that answered `response_id`, or None."""
        turn = self._turns.get(response_id) if isinstance(response_id, str) else None
        return next((r for r in router.replicas if turn is not None and r.name == turn.replica and r.healthy), None)

    def conversation(self, response_id: object, tenant: Optional[str]) -> Optional[list]:
        """Every item through `response_id`'s output, oldest first, if the ledger holds the whole chain and it is
        `tenant`'s; else None."""
        chain, current = [], response_id
        while current is not None:
            turn = self._turns.get(current) if isinstance(current, str) else None
            if turn is None or turn.tenant != tenant:
                return None
            chain.append(turn)
            current = turn.previous
        return [item for turn in reversed(chain) for item in turn.input_items + turn.output_items]


def _items_of(input_value: object) -> list:
    """A request's input as items (a string is one user message)."""
    if isinstance(input_value, str):
        return [{"type": "message", "role": "user", "content": input_value}]
    return list(input_value) if isinstance(input_value, list) else []


async def create_response(router: Router, ledger: ResponseLedger, request: Request) -> Response:
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
    tenant, previous = router.tenant_of(credentials), body.get("previous_response_id")
    owner = ledger.owner(router, previous)
    rebuilt = None  # the request carrying the whole conversation, for a replica that does not hold it
    conversation = ledger.conversation(previous, tenant) if previous is not None else None
    if conversation is not None:
        rest = {key: value for key, value in body.items() if key != "previous_response_id"}
        rebuilt = json.dumps({**rest, "input": conversation + _items_of(body.get("input"))}).encode()
    stored = body.get("store") is not False
    turn = Turn("", tenant, previous if isinstance(previous, str) else None, _items_of(body.get("input")))
    cache_key = body.get("prompt_cache_key") if isinstance(body.get("prompt_cache_key"), str) else None
    headers = forwarded_headers(credentials)
    tried: set[str] = set()
    while len(tried) < router.settings.max_attempts:
        replica = owner if owner is not None and not tried else router.choose(None, tried, cache_key=cache_key)
        if replica is None:
            break
        tried.add(replica.name)
        payload = raw if replica is owner or rebuilt is None else rebuilt
        ticket = router.record_route(replica, None, None)
        try:
            upstream = await post_to(router.client, replica, RESPONSES_PATH, payload, headers)
        except (httpx.TransportError, Stalled) as failure:
            router.release(replica, ticket)
            router.fail_over(replica, failure, f"on {RESPONSES_PATH}")
            continue
        turn.replica = replica.name
        if body.get("stream") is True and upstream.status_code == 200:
            return StreamingResponse(
                _relay(router, ledger if stored else None, turn, replica, ticket, upstream),
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
        if upstream.status_code == 200 and stored:
            answer = _json_of(content)
            ledger.learn(answer.get("id"), turn)
            ledger.answered(answer.get("id"), answer.get("output"))
        return relay_response(router, replica, upstream.status_code, upstream.headers, content)
    return error_response(
        503, "no healthy replica can take the request; retry shortly", "server_error", code="no_replica"
    )


def _json_of(content: bytes) -> dict:
    try:
        answer = json.loads(content)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


async def _relay(
    router: Router,
    ledger: Optional[ResponseLedger],
    turn: Turn,
    replica: Replica,
    ticket: int,
    upstream: httpx.Response,
) -> AsyncIterator[bytes]:
    """The replica's events as they come; the ledger (when the response is stored) learns the response from its
    response.created event and its output from the closing one."""
    pending = b""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
            if ledger is None:
                continue
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                _learn_from(ledger, turn, event)
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


def _learn_from(ledger: ResponseLedger, turn: Turn, event: bytes) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = _json_of(line[5:])
        response = payload.get("response") if isinstance(payload.get("response"), dict) else {}
        if payload.get("type") == "response.created":
            ledger.learn(response.get("id"), turn)
        elif payload.get("type") in ("response.completed", "response.incomplete"):
            ledger.answered(response.get("id"), response.get("output"))


async def stored_response(router: Router, ledger: ResponseLedger, request: Request, path: str) -> Response:
    """GET or DELETE of a stored response (or its input items): its owner, else each healthy replica in turn."""
    try:
        credentials = credentials_of(request.headers)
    except AmbiguousAuthorization as error:
        return error_response(400, str(error), code="ambiguous_authorization")
    response_id = request.path_params["response_id"]
    owner = ledger.owner(router, response_id)
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
            break
    if last is None:
        return error_response(503, "no healthy replica; retry shortly", "server_error", code="no_replica")
    replica, answer = last
    return relay_response(router, replica, answer.status_code, answer.headers, answer.content)
