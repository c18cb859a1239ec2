"""The parts of prefixserve.ray that need no Ray: the builder's arguments, the in-process ASGI call, and what
the request router knows of a replica (tests/test_ray_serve.py runs the whole on a real two-node cluster)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from prefixserve.cache import BlockKeyer, CacheScope
from prefixserve.ray.app_args import parse_app_args
from prefixserve.ray.asgi_call import ForwardedRequest, ResponseStart, call_asgi
from prefixserve.ray.replica_views import (
    ReplicaCacheView,
    RouteEstimate,
    pack_keys,
    ranked,
    unpack_keys,
)
from prefixserve.router.costs import CostModel
from prefixserve.router.policies import KVAware, RouteRequest


# ------------------------------------------------------------------ arguments
def test_deployment_options_and_serve_flags_are_told_apart():
    args = parse_app_args(
        {
            "num_replicas": "2",
            "num_cpus": "0.5",
            "block-size": "32",
            "no_prefix_caching": "true",
            "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"},
            "ingress_resources": '{"head": 0.01}',
        }
    )
    assert (args.num_replicas, args.num_cpus, args.ingress_resources) == (2, 0.5, {"head": 0.01})
    namespace = args.serve_namespace()
    assert namespace.block_size == 32 and namespace.enable_prefix_caching is False
    assert namespace.kv_events_config.enable_kv_cache_events is True
    # The field's own name works for a switch too: enable_prefix_caching=false is --no-prefix-caching.
    assert parse_app_args({"enable_prefix_caching": "false"}).serve_argv == ("--no-prefix-caching",)
    assert parse_app_args({"enable_prefix_caching": True}).serve_argv == ()


@pytest.mark.parametrize(
    "args, named",
    [
        ({"port": "9000"}, "port"),
        ({"host": "0.0.0.0"}, "host"),
        ({"num_replica": "2"}, "num_replica"),  # a typo is named, with what the builder takes
        ({"num_replicas": "two"}, "num_replicas"),
        ({"num_replicas": "0"}, "num_replicas"),
        ({"num_replicas": True}, "num_replicas"),
        ({"num_cpus": "-1"}, "num_cpus"),
        ({"routing_stats_period_s": "0"}, "routing_stats_period_s"),
        ({"ingress_resources": "{nope"}, "ingress_resources"),
        ({"ingress_resources": '{"head": -1}'}, "ingress_resources"),
        ({"block_size": "abc"}, "--block-size"),
        ({"block_size": "3"}, "--block-size"),
        ({"no_prefix_caching": "maybe"}, "no_prefix_caching"),
        ({"kv_events_config": "{not json"}, "--kv-events-config"),
    ],
)
def test_a_bad_argument_is_named_before_anything_deploys(args, named):
    with pytest.raises(ValueError) as raised:
        parse_app_args(args)
    assert named in str(raised.value)


# ------------------------------------------------------------------ ASGI call
def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {
            "body": (await request.body()).decode(),
            "query": request.url.query,
            "auth": request.headers.get("authorization"),
        }

    @app.get("/stream")
    async def stream():
        async def words():
            for word in ("one", "two", "three"):
                yield f"data: {word}\n\n"

        return StreamingResponse(words(), media_type="text/event-stream")

    return app


def _collect(app, request: ForwardedRequest) -> list:
    async def run():
        return [piece async for piece in call_asgi(app, request)]

    return asyncio.run(run())


def test_an_asgi_call_answers_as_the_app_would():
    pieces = _collect(
        _app(),
        ForwardedRequest(
            "POST",
            "/echo",
            b"a=1",
            [(b"authorization", b"Bearer k"), (b"content-type", b"application/json")],
            b'{"x": 1}',
        ),
    )
    assert isinstance(pieces[0], ResponseStart) and pieces[0].status == 200
    assert json.loads(b"".join(pieces[1:])) == {"body": '{"x": 1}', "query": "a=1", "auth": "Bearer k"}
    missing = _collect(_app(), ForwardedRequest("GET", "/nowhere", b"", [], b""))
    assert missing[0].status == 404


def test_an_asgi_stream_comes_back_chunk_by_chunk_and_a_client_may_leave_early():
    pieces = _collect(_app(), ForwardedRequest("GET", "/stream", b"", [], b""))
    assert pieces[1:] == [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]

    async def leave_after_first_chunk():
        stream = call_asgi(_app(), ForwardedRequest("GET", "/stream", b"", [], b""))
        start = await stream.__anext__()
        first = await stream.__anext__()
        await stream.aclose()  # the app is told the client went away and finishes
        return start, first

    start, first = asyncio.run(leave_after_first_chunk())
    assert start.status == 200 and first == b"data: one\n\n"


# ------------------------------------------------------------ replica views
SCOPE = CacheScope("model", "tokenizer", "")


def _route(tokens: list[int]) -> RouteRequest:
    keyer = BlockKeyer(16)
    return RouteRequest(keyer.keys(SCOPE.digest, tokens), tokens, SCOPE.digest, -(-len(tokens) // 16), 16)


def test_a_view_predicts_hits_from_the_report_and_from_what_it_routed():
    shared, other = list(range(64)), list(range(1000, 1064))
    route = _route(shared + [7, 8, 9])  # 4 full blocks and a tail
    view = ReplicaCacheView("a", CostModel())
    assert view.num_hit_blocks(route) == 0
    view.take_report(
        {"cache_keys": pack_keys(_route(shared[:32]).keys), "num_requests_waiting": 2, "kv_cache_usage": 0.25}
    )
    assert view.num_hit_blocks(route) == 2 and view.num_requests_waiting == 2 and view.kv_cache_usage == 0.25
    view.routed("r1", RouteEstimate(route, max_tokens=10))  # counted as held until a report says otherwise
    assert view.num_hit_blocks(route) == 4 and view.load > 0
    view.completed("r1")
    assert view.load == 0
    assert view.num_hit_blocks(_route(other)) == 0
    # A replica's host and disk tiers, after its device hit, as the planner prices them.
    fresh = ReplicaCacheView("b", CostModel())
    keys = route.keys
    fresh.take_report(
        {"cache_keys": pack_keys(keys[:1]), "tier_keys": {"CPU": pack_keys(keys[1:3]), "DISK": pack_keys(keys[3:])}}
    )
    assert fresh.num_hit_blocks(route) == 1 and fresh.lower_tier_run(route) == [("host", 2), ("disk", 1)]


def test_a_report_that_is_not_ours_predicts_nothing():
    view = ReplicaCacheView("a", CostModel())
    view.take_report({"cache_keys": b"123", "kv_cache_usage": 7})  # not a whole number of prefixes; no share
    assert view.held == frozenset() and unpack_keys(None) == frozenset() and view.kv_cache_usage == 0.0
    view.take_report("garbage")
    assert view.num_hit_blocks(_route(list(range(32)))) == 0


def test_the_policy_goes_where_the_prefix_is_and_failed_replicas_come_last():
    route = _route(list(range(256)))
    holder, empty = ReplicaCacheView("holder", CostModel()), ReplicaCacheView("empty", CostModel())
    holder.take_report({"cache_keys": pack_keys(route.keys)})
    views = [empty, holder]
    best = KVAware().choose(route, views)
    assert views[best] is holder
    assert ranked(views, best, frozenset()) == [1, 0]
    assert ranked(views, best, frozenset({"holder"})) == [0, 1]  # it failed this request: tried last
