"""The router's view of its fleet: which replicas are up, what they cache, where a request should go.

Background loops keep it current (health checks; KV-event mirrors; the scope and
block size, learned from the first replica that answers), all on the operator's
admin key, never a tenant's. Routing tokenizes with the replicas' tokenizer and
scope, so the router's block keys equal theirs, and asks the policy which replica
holds the longest prefix unless it is overloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Optional

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..cache import max_hit_blocks
from ..http_keys import AdminKey, Credentials, KeyTable
from ..metric_names import (
    CACHE_KEY_ROUTES,
    CONTINUED_STREAMS,
    FAILOVERS,
    PREDICTED_HIT_TOKENS,
    PREFILLS,
    REPLICA_HEALTHY,
    REPLICA_LOAD_SECONDS,
    ROUTED_REQUESTS,
)
from .cache_key import keyed_replica
from .costs import policy_options_for
from .policies import RouteRequest
from .policy_registry import make_policy
from .progress import ProgressClock, Stalled
from .replicas import Replica
from .route_keys import RouteKeys
from .settings import RouterSettings

logger = logging.getLogger("prefixserve.router")
DEFAULT_MAX_MODEL_LEN = 32768  # until a replica says its own
SCOPE_REFRESH_SECONDS = 10.0  # how often the scope is read again (a replica may have reloaded)
DEFAULT_OUTPUT_TOKENS = 256  # the server's default max_tokens, until a replica says its own


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["replica"]  # the replica's name, never its URL
        self.routed = Counter(ROUTED_REQUESTS, "Requests routed to each replica.", labels, registry=self.registry)
        self.predicted_hits = Counter(
            PREDICTED_HIT_TOKENS,
            "Prompt tokens predicted cached on the chosen replica.",
            labels,
            registry=self.registry,
        )
        self.failovers = Counter(FAILOVERS, "Requests moved off a failed replica.", labels, registry=self.registry)
        self.continued = Counter(
            CONTINUED_STREAMS,
            "Streams continued on this replica after another one failed.",
            labels,
            registry=self.registry,
        )
        self.load = Gauge(REPLICA_LOAD_SECONDS, "Estimated outstanding work.", labels, registry=self.registry)
        self.healthy = Gauge(
            REPLICA_HEALTHY, "1 when the replica passes health checks.", labels, registry=self.registry
        )
        self.cache_key_routes = Counter(
            CACHE_KEY_ROUTES,
            "Requests with a prompt_cache_key kept on its replica or overflowed to the policy.",
            ["outcome"],
            registry=self.registry,
        )
        self.prefills = Counter(
            PREFILLS,
            "Prefill phases of disaggregated requests: done on a prefill replica, "
            "refused by it, skipped (none answered: the decode replica computed the prompt), or "
            "local (short enough to prefill on the decode replica, --local-prefill-tokens).",
            ["outcome"],
            registry=self.registry,
        )


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        from ..model.default import default_tokenizer_dir  # the tokenizer only: no torch, no weights
        from ..model.tokenizers.tokenizer import Tokenizer

        self.settings = settings
        self.replicas = [
            Replica(url, name, settings.health_failure_threshold, role) for name, url, role in settings.replica_roles()
        ]
        self.policy = make_policy(settings.policy, policy_options_for(settings.cost))
        self.tokenizer = Tokenizer.from_dir(settings.model or default_tokenizer_dir())
        self.max_chars_per_token = self.tokenizer.max_chars_per_token  # computed once, over the vocabulary
        self.keys = KeyTable(settings.api_keys)
        self.admin = AdminKey(settings.admin_api_key, "router")  # who may read the fleet dashboard
        self.metrics = RouterMetrics()
        self.progress = ProgressClock(settings.progress_timeout)  # how long a stream may go without a chunk
        self.route_keys: Optional[RouteKeys] = None  # scope and block size, from the first replica that answers
        self._scope_learned_at = float("-inf")
        self.remote = None  # a read-only view of the replicas' shared remote tier (tiers.redis.RedisTier)
        self.max_model_len: Optional[int] = None
        self.default_output_tokens = DEFAULT_OUTPUT_TOKENS  # load estimate when a request gives no max_tokens
        # No pool limit (a full pool would read as a replica timing out), and idle connections are
        # dropped before a replica's keep-alive timeout (5 s in uvicorn) can close one under a request.
        self.client = httpx.AsyncClient(
            timeout=settings.request_timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
        )
        self._tickets = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()
        self._warned: set[str] = set()

    # ------------------------------------------------------------- background
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._sync_loop())]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._checks]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._checks, return_exceptions=True)
        await self.client.aclose()
        if self.remote is not None:
            self.remote.close()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self._check_health()
            except Exception:  # one bad answer must not leave the router blind to every replica from then on
                logger.exception("a health round failed; the next one runs in %.1f s", self.settings.health_interval)
            await asyncio.sleep(self.settings.health_interval)

    async def _check_health(self) -> None:
        await asyncio.gather(*(r.check_health(self.client, self.settings.control_timeout) for r in self.replicas))
        # Learn the scope once, then again now and then (a replica's hot reload changes it), and at once
        # when a replica came (back) up: it may serve another checkpoint now.
        if (
            self.route_keys is None
            or time.monotonic() - self._scope_learned_at >= SCOPE_REFRESH_SECONDS
            or any(r.healthy and r.can_mirror and r.model_fingerprint is None for r in self.replicas)
        ):
            await self._learn_scope()

    async def _sync_loop(self) -> None:
        while True:
            headers = self.control_headers()
            try:
                await asyncio.gather(
                    *(r.sync(self.client, headers, self.settings.control_timeout) for r in self.replicas)
                )
            except Exception:  # as the health loop: the next round runs whatever this one met
                logger.exception("a mirror sync round failed; the next one runs in %.1f s", self.settings.sync_interval)
            await asyncio.sleep(self.settings.sync_interval)

    def control_headers(self) -> dict:
        key = self.settings.admin_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    def check_soon(self, replica: Replica) -> None:
        """Health-check a replica now (it answered a 5xx): the check, not the answer, decides whether it is down."""
        task = asyncio.create_task(replica.check_health(self.client, self.settings.control_timeout))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    async def _learn_scope(self) -> None:
        """Read every healthy replica's model version; take the scope and block size from the first that
        answers (refusing one whose tokenizer differs from ours)."""
        learned = None
        for replica in self.replicas:
            if not replica.healthy:
                continue
            try:
                response = await self.client.get(
                    replica.url + "/v1/cache/info",
                    headers=self.control_headers(),
                    timeout=self.settings.control_timeout,
                )
            except httpx.TimeoutException:
                continue  # busy with a step, not down: another replica, or this one next time
            except httpx.TransportError as failure:
                replica.mark_down(f"transport failure reading cache info: {failure!r}")
                continue
            try:
                info = response.json() if response.status_code == 200 else None
                if info is not None:
                    fingerprint = info["model_fingerprint"]
                    replica.model_fingerprint = fingerprint if isinstance(fingerprint, str) and fingerprint else None
                if info is not None and info["tokenizer_fingerprint"] != self.tokenizer.fingerprint:
                    self._warn_once(
                        f"tokenizer:{replica.name}",
                        "replica %s uses another tokenizer than the "
                        "router's --model; its keys would never match: start the router with the "
                        "replicas' --model",
                        replica.name,
                    )
                    continue
                if info is None:
                    self._warn_once(
                        f"info:{replica.name}",
                        "replica %s answers %d on /v1/cache/info, so requests are "
                        "routed by load only; give replicas and router the same --admin-api-key",
                        replica.name,
                        response.status_code,
                    )
                    continue
                if learned is not None:
                    continue  # the scope is the first replica's; this one's version is noted
                route_keys = RouteKeys.of(info)
                max_model_len = info.get("max_model_len")
                self.max_model_len = max_model_len if isinstance(max_model_len, int) else None
                default_max_tokens = info.get("default_max_tokens")
                if isinstance(default_max_tokens, int) and default_max_tokens > 0:
                    self.default_output_tokens = default_max_tokens
            except (KeyError, TypeError, ValueError) as error:
                self._warn_once(
                    f"info:{replica.name}", "replica %s: unreadable /v1/cache/info (%r)", replica.name, error
                )
                continue
            scope = route_keys.scoper.scope
            if self.route_keys is not None and self.route_keys.scoper.scope != scope:
                logger.info(
                    "replica %s serves a new model version (%s): routing keys follow it",
                    replica.name,
                    scope.model_fingerprint[:12],
                )
            learned = self.route_keys = route_keys
            self._scope_learned_at = time.monotonic()
            self._open_remote(scope.digest)

    # ---------------------------------------------------------------- routing
    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len or DEFAULT_MAX_MODEL_LEN

    @property
    def max_prompt_chars(self) -> int:
        """Past this many characters a prompt cannot fit any replica: it is routed by load, not tokenized."""
        return self.max_prompt_tokens * self.max_chars_per_token

    def tenant_of(self, credentials: Credentials) -> Optional[str]:
        return self.keys.tenant_of(credentials) if self.keys else None

    def _open_remote(self, scope_digest: bytes) -> None:
        """Look requests up in the replicas' shared remote tier (read only: the router never writes)."""
        if self.remote is not None and self.remote.scope_digest != scope_digest:
            self.remote.rescope(scope_digest)
        if self.settings.kv_remote_url and self.remote is None:
            from ..tiers.redis import RedisTier  # imports redis only when asked

            self.remote = RedisTier(
                self.settings.kv_remote_url, scope_digest=scope_digest, read_timeout=self.settings.kv_remote_timeout
            )

    async def with_remote_run(self, route: Optional[RouteRequest]) -> Optional[RouteRequest]:
        """The route with the leading run of its keys the remote tier holds (one round trip, off the loop)."""
        if route is None or self.remote is None:
            return route
        limit = max_hit_blocks(route.num_blocks, 1, len(route.keys))
        num_remote = await asyncio.to_thread(self.remote.contains, route.keys[:limit])
        return dataclasses.replace(route, remote_blocks=num_remote)

    def route_request(
        self, token_ids: list[int], salt: Optional[str], model: Optional[str] = None
    ) -> Optional[RouteRequest]:
        return self.route_keys.route_request(token_ids, salt, model) if self.route_keys is not None else None

    def choose(
        self,
        route: Optional[RouteRequest],
        exclude: set[str],
        version: Optional[str] = None,
        cache_key: Optional[str] = None,
        role: str = "generate",
    ) -> Optional[Replica]:
        """The replica for a request, among the healthy ones not in `exclude` that serve what it needs: given a
        version (a request for 'name@fp_...', a stream's continuation), those whose fingerprint begins with it, or
        failing any, those whose version the router could not read (the replica checks it and answers 404 if it
        differs). Given a prompt_cache_key, the replica that key belongs to unless it is overloaded (cache_key.py).
        `role` "generate" takes the replicas that answer requests ("both" and "decode"), "prefill" the prefill
        replicas."""
        roles = ("prefill",) if role == "prefill" else ("both", "decode")
        candidates = [r for r in self.replicas if r.healthy and r.name not in exclude and r.role in roles]
        if version is not None:
            candidates = [r for r in candidates if r.version_matches(version)] or [
                r for r in candidates if r.version_matches(version) is None
            ]
        if not candidates:
            return None
        if cache_key is not None:
            keyed = keyed_replica(cache_key, candidates, self.settings.cache_key_slack)
            self.metrics.cache_key_routes.labels("kept" if keyed is not None else "overflowed").inc()
            if keyed is not None:
                return keyed
        if route is None:
            return min(candidates, key=lambda r: r.load)
        return candidates[self.policy.choose(route, candidates)]

    async def read_model_fingerprints(self, exclude: set[str]) -> None:
        """Read again the model version each healthy replica not in `exclude` serves (/v1/cache/info): a stream
        is continued only after this, as a reload may have changed a version since the last refresh (up to
        SCOPE_REFRESH_SECONDS ago). A replica that does not answer keeps the version last read (busy) or none
        (no admin key); the pinned request it may get next is its own check."""
        await asyncio.gather(
            *(self._read_model_fingerprint(r) for r in self.replicas if r.healthy and r.name not in exclude)
        )

    async def _read_model_fingerprint(self, replica: Replica) -> None:
        try:
            response = await self.client.get(
                replica.url + "/v1/cache/info", headers=self.control_headers(), timeout=self.settings.control_timeout
            )
            fingerprint = response.json().get("model_fingerprint") if response.status_code == 200 else None
        except httpx.TimeoutException:
            return
        except httpx.TransportError as failure:
            replica.mark_down(f"transport failure reading cache info: {failure!r}")
            return
        except (ValueError, AttributeError):  # an answer the router cannot read
            return
        if isinstance(fingerprint, str) and fingerprint:
            replica.model_fingerprint = fingerprint

    def serves_version(self, version: str) -> bool:
        """Whether a healthy replica serves (or may serve: its version unread) this model version."""
        return any(r.healthy and r.version_matches(version) is not False for r in self.replicas)

    def record_route(self, replica: Replica, route: Optional[RouteRequest], max_tokens: Optional[int]) -> int:
        """Count the request against the replica's load until `release`; returns its ticket."""
        cost = self.settings.cost
        hit_tokens = prompt_tokens = 0
        if route is not None:
            hit_tokens = replica.num_hit_blocks(route) * route.tokens_per_block
            prompt_tokens = len(route.token_ids)
            replica.expect(route.keys)  # optimistic: the replica is about to cache this prompt's full blocks
        ticket = next(self._tickets)
        replica.outstanding[ticket] = cost.request_seconds(
            prompt_tokens, hit_tokens, max_tokens or self.default_output_tokens
        )
        replica.num_routed += 1
        replica.num_predicted_hit_tokens += hit_tokens
        self.metrics.routed.labels(replica.name).inc()
        self.metrics.predicted_hits.labels(replica.name).inc(hit_tokens)
        return ticket

    @staticmethod
    def release(replica: Replica, ticket: int) -> None:
        replica.outstanding.pop(ticket, None)

    def fail_over(self, replica: Replica, failure: Exception, during: str) -> None:
        """A transport failure (refused, reset, timed out): the replica is down until a health check passes."""
        replica.num_failures += 1
        self.metrics.failovers.labels(replica.name).inc()
        replica.mark_down(f"transport failure {during}: {failure!r}", hung=isinstance(failure, Stalled))

    def model_versions(self) -> dict[str, list[str]]:
        """Model fingerprint (first 12 hex digits; "unknown" where unread) -> the healthy replicas serving it."""
        versions: dict[str, list[str]] = {}
        for replica in self.replicas:
            if replica.healthy:
                versions.setdefault(replica.version or "unknown", []).append(replica.name)
        return versions

    def refresh_gauges(self) -> None:
        for replica in self.replicas:
            self.metrics.load.labels(replica.name).set(replica.load)
            self.metrics.healthy.labels(replica.name).set(1.0 if replica.healthy else 0.0)
