"""One real replica as the router sees it: health, a mirror of its cached keys, its outstanding work.

The mirror is kept current from the replica's KV events (`/v1/kv_events?since=`);
after a restart of either side, or when the replica dropped events the router
never saw, it is rebuilt from a snapshot of the replica's keys (`/v1/cache/keys`).
Routing also adds a request's keys optimistically, so a burst of requests with
one prefix sticks to one replica before its events arrive; keys added so in the
last EXPECTED_KEY_SECONDS survive a snapshot, which may have been taken before
the replica stored them.

Only the replica's own failures take it out: a connection refused or reset, a
/health that is not 200, or /health timing out several checks in a row. Busy is
not down: a control call (KV events, cache keys, cache info) that times out leaves
the replica up and its mirror as it was, and a single slow /health (an event loop
held up on a loaded host) is only counted. A
response, even a 5xx, is an answer to one request and never marks a replica down.
Down is not always hung: a replica that refuses new connections may be draining
before a restart, so the requests it holds are left to finish (see `mark_down`).
Each time it goes down the reason is kept in `down_reasons`, so an operator (and a
test) can see why.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from typing import NamedTuple, Optional

import httpx

from ..cache import event_from_dict, max_hit_blocks
from .policies import RouteRequest
from .prefix_mirror import PrefixMirror

logger = logging.getLogger("prefixserve.router")
EXPECTED_KEY_SECONDS = 30.0  # how long a routed request's keys count as cached without the replica's word
MAX_EXPECTED_KEYS = 1 << 16
REPLICA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class MarkedDown(NamedTuple):
    time: float  # time.time() when the replica was taken out
    reason: str


def parse_replica(spec: str, index: int) -> tuple[str, str]:
    """`URL` or `NAME=URL` -> (name, url); unnamed replicas are `replica-<index>`."""
    name, separator, url = spec.partition("=")
    if separator and "://" not in name:
        if not REPLICA_NAME.fullmatch(name):
            raise ValueError(
                f"replica name {name!r} in {spec!r}: use letters, digits, '.', '_' or '-' "
                "(up to 64), e.g. --replica gpu-a=http://10.0.0.5:8000"
            )
    else:
        name, url = f"replica-{index}", spec
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"replica {spec!r}: give its base URL, e.g. http://127.0.0.1:8001 or name=http://...")
    return name, url.rstrip("/")


class Replica:
    def __init__(
        self, url: str, name: Optional[str] = None, health_failure_threshold: int = 3, role: str = "both"
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.role = role  # "both", or its part in prefill/decode disaggregation: "prefill" or "decode"
        self.mirror = PrefixMirror()
        self.healthy = False
        self.cursor: Optional[int] = None  # event sequence the mirror is current to; None: needs a snapshot
        self.has_events = True
        self.can_mirror = True  # False while the replica refuses the router's control calls (key, version)
        self.outstanding: dict[int, float] = {}  # in-flight request -> estimated seconds of work
        self.num_routed = 0
        self.num_predicted_hit_tokens = 0
        self.num_failures = 0
        self.down_reasons: deque[MarkedDown] = deque(maxlen=100)
        self.health_failure_threshold = health_failure_threshold  # /health timeouts in a row that take it out
        self.health_timeouts = 0  # in a row, reset by any answer
        # The model version it serves (/v1/cache/info's model_fingerprint); None until read, or when the router
        # may not read it (no admin key). A stream continues only where this equals its first replica's.
        self.model_fingerprint: Optional[str] = None
        self.went_down = (
            asyncio.Event()
        )  # set when it is marked down as hung: requests waiting on it move (progress.py)
        self.expected: dict[bytes, float] = {}  # key -> time.monotonic() a request that will store it was routed

    def expect(self, keys) -> None:
        """A request with these keys was routed here: count them as cached until the replica says otherwise."""
        self.mirror.keys.update(keys)
        self.expected.update(dict.fromkeys(keys, time.monotonic()))
        if len(self.expected) > MAX_EXPECTED_KEYS:  # between snapshots (rare with KV events) keep it bounded
            self._forget_old_expected()

    def _forget_old_expected(self) -> None:
        recent = time.monotonic() - EXPECTED_KEY_SECONDS
        self.expected = {key: at for key, at in self.expected.items() if at >= recent}

    def version_matches(self, version: str) -> Optional[bool]:
        """Whether its model fingerprint begins with these hex digits; None while its version is unread."""
        return None if self.model_fingerprint is None else self.model_fingerprint.startswith(version)

    @property
    def version(self) -> Optional[str]:
        """Its model fingerprint's first 12 hex digits, as /health and the dashboard name a version."""
        return self.model_fingerprint[:12] if self.model_fingerprint else None

    @property
    def load(self) -> float:
        return sum(self.outstanding.values())

    def num_hit_blocks(self, request: RouteRequest) -> int:
        return self.mirror.num_hit_blocks(request) if self.healthy else 0

    def lower_tier_run(self, request: RouteRequest) -> list[tuple[str, int]]:
        """The consecutive run right after this replica's device hit that lies below its pool: its own host
        and disk tiers (mirrored from KV events of media CPU and DISK), then the fleet's remote tier."""
        position = self.num_hit_blocks(request)
        limit = max_hit_blocks(request.num_blocks, 1, len(request.keys))
        run = []
        for medium, tier in (("CPU", "host"), ("DISK", "disk")):
            count = self.mirror.leading_run(medium, request.keys, position, limit)
            if count:
                run.append((tier, count))
                position += count
        if request.remote_blocks > position:
            run.append(("remote", request.remote_blocks - position))
        return run

    def mark_down(self, reason: str, hung: bool = False) -> None:
        """Take it out of routing. `hung`: it stopped answering on the connections it holds (its /health timed
        out, a request heard nothing for the progress deadline) or says it cannot serve (/health not 200), so the
        requests waiting on it move at once. Otherwise (refused or reset connections) the requests it holds stay: a
        replica that drains before a restart finishes them, a dead one resets them, and beats catch a hang."""
        if self.healthy:
            logger.warning("replica %s (%s) is down: %s", self.name, self.url, reason)
            self.down_reasons.append(MarkedDown(time.time(), reason))
        self.healthy = False
        if hung:
            self.went_down.set()
        self.cursor = None
        self.mirror.clear()
        self.expected.clear()

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("replica %s (%s) is up", self.name, self.url)
            self.has_events = self.can_mirror = True  # it may have restarted with other options
            self.model_fingerprint = None  # ... or on another checkpoint: read it again before trusting it
            self.went_down = asyncio.Event()
        self.healthy = True

    async def check_health(self, client: httpx.AsyncClient, timeout: float) -> None:
        try:
            response = await client.get(self.url + "/health", timeout=timeout)
        except httpx.TimeoutException as error:
            self.health_timeouts += 1
            if self.health_timeouts >= self.health_failure_threshold:
                self.mark_down(
                    f"health check failed: timed out {self.health_timeouts} times in a row ({error!r})", hung=True
                )
            return
        except httpx.TransportError as error:
            self.mark_down(f"health check failed: {error!r}")
            return
        self.health_timeouts = 0
        if response.status_code != 200:
            self.mark_down(f"health check answered {response.status_code}", hung=True)  # it says it cannot serve
            return
        self.mark_up()

    async def sync(self, client: httpx.AsyncClient, headers: dict, timeout: float) -> None:
        """Bring the mirror up to date: events since the cursor, or a fresh snapshot."""
        if not self.healthy or not self.can_mirror:
            return
        try:
            if self.cursor is not None and self.has_events:
                response = await client.get(
                    f"{self.url}/v1/kv_events", params={"since": self.cursor}, headers=headers, timeout=timeout
                )
                if response.status_code == 404 and "--enable-kv-events" in response.text:
                    self.has_events = False  # replica runs without --enable-kv-events: snapshots only
                elif self._refused(response, "/v1/kv_events"):
                    return
                else:
                    body = response.json()
                    if body["complete"]:
                        for event in body["events"]:
                            self.mirror.apply(event_from_dict(event))
                        self.cursor = body["next"]
                        return
            response = await client.get(self.url + "/v1/cache/keys", headers=headers, timeout=timeout)
            if self._refused(response, "/v1/cache/keys"):
                return
            body = response.json()
            self._forget_old_expected()
            self.mirror.keys = {bytes.fromhex(key) for key in body["keys"]} | self.expected.keys()
            self.mirror.tier_keys = {
                medium: {bytes.fromhex(key) for key in keys} for medium, keys in (body.get("tiers") or {}).items()
            }
            self.cursor = body["next"]
        except httpx.TimeoutException:
            logger.debug("replica %s: cache sync timed out (busy with a step); trying again", self.name)
        except httpx.TransportError as error:
            self.mark_down(f"transport failure during cache sync: {error!r}")
        except (KeyError, TypeError, ValueError) as error:
            self.cursor = None  # an answer the router cannot read: start over from a snapshot
            logger.debug("replica %s: unreadable cache sync answer (%r)", self.name, error)

    def _refused(self, response: httpx.Response, path: str) -> bool:
        """A control call the replica will not answer (no admin key, wrong key, older server): route by load."""
        if response.status_code == 200:
            return False
        if response.status_code in (401, 403, 404, 405):
            self.can_mirror = False
            self.mirror.clear()
            logger.warning(
                "replica %s answers %s on %s, so the router cannot mirror its cache and routes to it by "
                "load only; start replicas and router with the same --admin-api-key",
                self.name,
                response.status_code,
                path,
            )
            return True
        self.cursor = None  # a transient 5xx or 429: try a snapshot next time
        return True
