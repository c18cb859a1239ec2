"""One real replica as the router sees it: health, a mirror of its cached keys, its outstanding work.

The mirror is kept current from the replica's KV events (`/v1/kv_events?since=`);
after a restart of either side, or when the replica dropped events the router
never saw, it is rebuilt from a snapshot of the replica's keys (`/v1/cache/keys`).
Routing also adds a request's keys optimistically, so a burst of requests with
one prefix sticks to one replica before its events arrive.
"""

from __future__ import annotations

import logging
from typing import Optional

import httpx

from ..cache import event_from_dict
from .policies import PrefixMirror, RouteRequest

logger = logging.getLogger("prefixserve.router")


class Replica:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.name = self.url
        self.mirror = PrefixMirror()
        self.healthy = False
        self.cursor: Optional[int] = None  # event sequence the mirror is current to; None: needs a snapshot
        self.has_events = True
        self.outstanding: dict[int, float] = {}  # in-flight request -> estimated seconds of work
        self.num_routed = 0
        self.num_predicted_hit_tokens = 0
        self.num_failures = 0

    @property
    def load(self) -> float:
        return sum(self.outstanding.values())

    def num_hit_blocks(self, request: RouteRequest) -> int:
        return self.mirror.num_hit_blocks(request) if self.healthy else 0

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("replica %s is down: %s", self.url, reason)
        self.healthy = False
        self.cursor = None
        self.mirror.keys.clear()

    async def check_health(self, client: httpx.AsyncClient, timeout: float) -> None:
        try:
            response = await client.get(self.url + "/health", timeout=timeout)
            ok = response.status_code == 200
        except httpx.HTTPError as error:
            ok, response = False, error
        if not ok:
            self.mark_down(f"health check failed ({response})")
            return
        if not self.healthy:
            logger.info("replica %s is up", self.url)
        self.healthy = True

    async def sync(self, client: httpx.AsyncClient, headers: dict, timeout: float) -> None:
        """Bring the mirror up to date: events since the cursor, or a fresh snapshot."""
        if not self.healthy:
            return
        try:
            if self.cursor is not None and self.has_events:
                response = await client.get(f"{self.url}/v1/kv_events", params={"since": self.cursor},
                                            headers=headers, timeout=timeout)
                if response.status_code == 404:
                    self.has_events = False  # replica runs without --enable-kv-events
                else:
                    body = response.json()
                    if body["complete"]:
                        for event in body["events"]:
                            self.mirror.apply(event_from_dict(event))
                        self.cursor = body["next"]
                        return
            response = await client.get(self.url + "/v1/cache/keys", headers=headers, timeout=timeout)
            body = response.json()
            self.mirror.keys = {bytes.fromhex(key) for key in body["keys"]}
            self.cursor = body["next"]
        except (httpx.HTTPError, KeyError, ValueError) as error:
            self.mark_down(f"cache sync failed ({error!r})")
