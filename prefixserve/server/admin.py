"""Operator endpoints a router needs: KV events, cached block keys, and the scope to compute them.

Each answers the admin key only (see auth.py): block keys let a caller confirm a
guess of someone's prompt, so no tenant may read them. Events carry keys, never
token ids: a router needs no tokens to mirror what a replica holds.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..cache.events import event_to_dict
from ..engine.tenant_report import tenant_report
from ..http import APIError


def _public_event(event) -> dict:
    body = event_to_dict(event)
    if "token_ids" in body:
        body["token_ids"] = []
    return body


admin_routes = APIRouter()


def _admin_state(request: Request):
    return request.app.state.server  # admin_only, the router's dependency, has checked the key


@admin_routes.get("/v1/kv_events")
async def kv_events(request: Request, since: int = 0):
    """KV events numbered >= `since`; `complete: false` means some were dropped: resync from /v1/cache/keys."""
    queue = _admin_state(request).engine.queries.events
    if queue is None:
        raise APIError(
            404,
            "KV events are off; start the server with --enable-kv-events",
            "not_found_error",
            code="kv_events_disabled",
        )
    events, next_cursor, complete = queue.since(since)  # the queue is thread-safe
    return {"events": [_public_event(e) for e in events], "next": next_cursor, "complete": complete}


@admin_routes.get("/v1/cache/keys")
async def cache_keys(request: Request):
    """Every cached block key (hex) and the event cursor it is current to, read without waiting for the
    engine's step (a router polls this; busy must never look like down).

    The cursor is read first, then the keys (engine/queries.py says why that is consistent)."""
    cached = _admin_state(request).engine.queries.cached_keys()
    return {
        "keys": [key.hex() for key in cached.pool],
        "tiers": {medium: [key.hex() for key in found] for medium, found in cached.tiers.items()},
        "next": cached.next_event,
    }


@admin_routes.get("/v1/cache/stats")
async def cache_stats(request: Request):
    """What the TTL planner takes: the reuse-gap histograms (overall and per tenant), the TTL settings,
    pool usage; and the tenants' shares with what each holds against them (pool blocks, pins, tier bytes)
    and its cache counters."""
    state = _admin_state(request)

    def stats(core):
        usage = core.cache.usage()
        return {
            "object": "cache.stats",
            **core.reuse_gaps.stats_body(),
            "block_size": core.config.block_size,
            "prefix_ttl": core.config.prefix_ttl,
            "max_cache_ttl": state.settings.max_cache_ttl,
            "usage": {
                "num_blocks": usage.num_blocks,
                "num_free_blocks": usage.num_free_blocks,
                "num_cached_blocks": usage.num_cached_blocks,
                "num_pinned_blocks": usage.num_pinned_blocks,
                "num_min_share_overrides": core.cache.stats.num_min_share_overrides,
            },
            **tenant_report(core),
        }

    return await state.engine.call(stats)


@admin_routes.get("/v1/cache/info")
async def cache_info(request: Request):
    """What a router needs to compute the same block keys as this replica. Read without waiting for the
    engine's step: a hot reload replaces the scope in one assignment, and the rest is fixed at start-up."""
    return cache_info_body(_admin_state(request))


def cache_info_body(state) -> dict:
    """/v1/cache/info's body for a server's state (a Ray replica hands it to its ingress the same way)."""
    settings, queries = state.settings, state.engine.queries
    version = queries.version  # one object: a reload swaps the whole of it
    scope = version.scope
    return {
        "model_fingerprint": scope.model_fingerprint,
        "tokenizer_fingerprint": scope.tokenizer_fingerprint,
        "adapter_id": scope.adapter_id,
        "numerics": scope.numerics,
        "block_size": queries.block_size,
        "prefix_hash": queries.prefix_hash,
        "shared_prefixes": queries.shared_prefixes(),
        "max_model_len": version.max_model_len,
        "served_model_name": settings.served_model_name,
        "default_max_tokens": settings.default_max_tokens,
        "lora_adapters": lora_fingerprints(state),
    }


def lora_fingerprints(state) -> dict:
    """LoRA model name -> its weights' fingerprint (the scope's adapter_id), for a router to key a request for an
    adapter as this replica does. Adapters are read at start-up or by the load route: this reads the registry."""
    adapters = state.engine.engine.inputs.adapters
    if adapters is None:
        return {}
    fingerprints = {}
    for lora in state.settings.lora_modules.requests():
        try:
            fingerprints[lora.lora_name] = adapters.resolve(lora).fingerprint
        except ValueError:  # its files changed into something unservable: requests for it are refused
            continue
    return fingerprints
