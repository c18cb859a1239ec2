"""The KV hierarchy under the device pool, as the engine drives it: host RAM, then local disk.

    device pool ──LRU eviction──> host tier          (on eviction: a cold block's KV is copied out
         │                                            before its slot is reused)
         └──every block computed──> disk tier        (write-through, on a background thread: a restart
                                                      finds what was computed seconds before)

    a waiting request: device match ─> host run ─> disk run ─> remote run ─> fetch or recompute
                       (tiers/policy.py: find_run, then choose_fetch under kv_fetch_policy)
        a synchronous tier (host): read now, copied into fresh pool blocks and cached there
        the others (disk, remote): read on their threads; the request waits (not the engine), then the same

Tiers are driven by what they declare (KVTier.traits: synchronous, write-through, shared), never
by their names.

Fetched blocks are promoted into the device radix as ordinary cached blocks, so admission
then matches them like any device hit. Every record read is verified (key, scope, tokens,
dtype, shape, checksum or seal, finite values) before its bytes reach the pool; a bad one is
deleted, counted and recomputed, never used. A read that takes longer than the tier deadline
is given up: the request recomputes, the tier is counted slow, and it is not asked again
until that read has returned (a hung file or server costs one deadline, not one per request).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..cache import Block, BlockKeyer, RadixCache, max_hit_blocks
from ..config import DEFAULT_DISK_CACHE_BYTES
from ..cache.events import BlockRemoved, BlockStored
from ..cache.keys import unpack_tokens
from ..cache.stats import LatencyHistogram
from ..tiers import (BlockRecord, DiskTier, HostTier, Keyring, KVTier, RecordError, RecordExpectation, Sealer,
                     TierStats, choose_fetch, decode_record, find_run)
from ..tiers.record import DTYPE_SIZES
from .device import TORCH_DTYPES
from .request import Request
from .runner import ModelRunner

logger = logging.getLogger("prefixserve")
FETCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
FETCH_WAIT_SECONDS = 0.005  # an idle engine waits this long for a disk read before stepping again
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 2e-4  # until the engine has measured its own prefill
DEFAULT_TIER_DEADLINE = 0.5  # EngineConfig.kv_tier_deadline



@dataclass
class TierFetch:
    """A request's lower-tier lookup: where its run continues and what was read back."""

    request: Request
    start: int  # first block index the tiers serve (after the device hit)
    num_blocks: dict[str, int] = field(default_factory=dict)  # promoted blocks per tier
    pending: Optional[concurrent.futures.Future] = None  # a disk read in flight
    pending_keys: list[bytes] = field(default_factory=list)
    pending_start: int = 0
    pending_tier: str = ""
    pending_since: float = 0.0


@dataclass(frozen=True)
class TierSnapshot:
    stats: TierStats
    used_bytes: int
    capacity_bytes: int
    hit_tokens: int
    fetch_buckets: list[tuple[str, int]]
    fetch_seconds_sum: float
    rejections: dict[str, int] = field(default_factory=dict)  # by reason


class TieredKV:
    def __init__(self, tiers: Sequence[KVTier], runner: ModelRunner, cache: RadixCache, keyer: BlockKeyer,
                 scope_digest: bytes, fetch_policy: str = "cost", deadline: float = DEFAULT_TIER_DEADLINE) -> None:
        self.tiers = {tier.name: tier for tier in tiers}
        self.deadline = deadline  # seconds a request waits for a tier read before it recomputes
        self.stalled: dict[str, concurrent.futures.Future] = {}  # tier -> a read given up on, still running
        self.fetch_policy = fetch_policy  # EngineConfig.kv_fetch_policy
        self.runner, self.cache, self.keyer = runner, cache, keyer
        self.block_size = cache.block_size
        self.scope_digest = scope_digest  # the model's unsalted scope: records of another model never load
        self.shape, self.dtype = runner.block_shape, runner.dtype_name
        self.block_bytes = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        self.prefill_seconds_per_token = DEFAULT_PREFILL_SECONDS_PER_TOKEN
        self.hit_tokens: dict[str, int] = {name: 0 for name in self.tiers}
        self.fetch_latency = {name: LatencyHistogram(FETCH_BUCKETS) for name in self.tiers}
        self.fetches: dict[str, TierFetch] = {}  # request id -> its lookup
        self._written: list[tuple[Block, Optional[str]]] = []  # (block just cached, tier it came from)
        self._promoting_from: Optional[str] = None
        # Tiers every computed block is written to, in the background (disk: durability, remote: the fleet),
        # and those that keep what the pool evicts (host).
        self.write_tiers = [tier for tier in tiers if tier.traits.write_through]
        self.spill_tiers = [tier for tier in tiers if not tier.traits.write_through]
        if self.spill_tiers:
            cache.on_evict = self._spill
        if cache.events is not None:  # KV events carry each local tier's medium, so a router can mirror them
            for tier in tiers:
                if tier.traits.event_medium is not None:
                    self._publish_tier_events(tier, tier.traits.event_medium, cache.events)
        if self.write_tiers:
            cache.on_insert = self._note_written

    # ------------------------------------------------------------------ writing down
    def _record(self, block: Block, payload: bytes) -> BlockRecord:
        parent = block.parent
        return BlockRecord(key=block.key, parent_key=parent.key if isinstance(parent, Block) else None,
                           scope_digest=self.scope_digest, token_ids=tuple(unpack_tokens(block.token_bytes)),
                           dtype=self.dtype, shape=self.shape, payload=payload, tenant_scope=block.scope or b"")

    def _spill(self, block: Block) -> None:
        """A cold block leaves the pool: keep its KV in host RAM (its slot is still intact), unless its
        request said its KV never leaves the device (cache_retention "device")."""
        if block.device_only:
            return
        record = self._record(block, self.runner.read_blocks([block.block_id])[0])
        for tier in self.spill_tiers:
            tier.put([record])

    def _publish_tier_events(self, tier: KVTier, medium: str, events) -> None:
        block_size = self.block_size
        tier.watch(lambda key: events.publish(BlockStored([key], None, [], block_size, medium)),
                   lambda key: events.publish(BlockRemoved([key], medium)))

    def __getitem__(self, name: str) -> KVTier:
        return self.tiers[name]

    @property
    def shared(self) -> Optional[KVTier]:
        """The fleet's shared tier, if this replica has one."""
        return next((tier for tier in self.tiers.values() if tier.traits.shared), None)

    def rescope(self, scope_digest: bytes) -> dict[str, int]:
        """A hot reload made `scope_digest` the model's scope (call with no request in flight): this
        replica's own tiers delete the old scope's records, which could never load again (returns how
        many per tier); a shared tier switches to the new scope's keys and leaves the old ones to
        replicas still serving that version."""
        self.scope_digest = scope_digest
        self.fetches.clear()
        self._written.clear()
        reclaimed: dict[str, int] = {}
        for name, tier in self.tiers.items():
            tier.flush()  # a queued write of the old scope must not land after the purge
            count = tier.rescope(scope_digest)
            if count is not None:
                reclaimed[name] = count
        return reclaimed

    def tier_keys(self) -> dict[str, list[bytes]]:
        """Every key each published tier holds, by KV-event medium (for a router's snapshot)."""
        return {tier.traits.event_medium: tier.keys() for tier in self.tiers.values()
                if tier.traits.event_medium is not None}

    def _note_written(self, block: Block) -> None:
        if not block.device_only:
            self._written.append((block, self._promoting_from))

    def write_through(self) -> None:
        """Blocks cached this step go to the write-through tiers in the background (their KV is written now).

        A block computed here goes to every one; a block brought back from a tier is not written back to it,
        nor to a shared tier (the fleet had it, or our own tiers wrote it when it was computed).
        """
        if not self._written:
            return
        written, self._written = self._written, []
        payloads: dict[int, bytes] = {}
        for tier in self.write_tiers:
            blocks = [block for block, source in written if block.key is not None and source != tier.name
                      and not (source is not None and tier.traits.shared)]
            if not tier.traits.shared:  # already there: a look-up in this replica's own index
                blocks = [block for block in blocks if not tier.contains([block.key])]
            missing = [block.block_id for block in blocks if block.block_id not in payloads]
            if missing:
                payloads.update(zip(missing, self.runner.read_blocks(missing)))
            if blocks:
                tier.put_async([self._record(block, payloads[block.block_id]) for block in blocks])

    # ------------------------------------------------------------------ reading back
    def prepare(self, waiting: Sequence[Request], enable_prefix_caching: bool) -> None:
        """Look newly waiting requests up in the tiers once; promote host blocks now, start disk reads.

        Only requests near the head of the queue, whose prompts fit in the room the pool has now:
        promoting for a whole burst at once would have the burst's blocks evict one another before
        any of its requests is admitted.
        """
        if not enable_prefix_caching:
            return
        room = self.cache.pool.num_free_blocks + self.cache.num_reclaimable_blocks
        for request in waiting:
            room -= -(-request.num_prompt_tokens // self.block_size)
            if room < 0:
                return  # it would not be admitted this step: look it up when its turn comes
            if request.request_id in self.fetches or request.num_cached_tokens >= 0:
                continue  # looked up already, or admitted before (a preempted request)
            keys = self.keyer.extend(request.block_keys, request.scope_digest, request.token_ids,
                                     request.private_from)
            limit = max_hit_blocks(request.num_prompt_tokens, self.block_size, len(keys))
            hit = self.cache.match(request.scope_digest, keys, request.token_ids, record_stats=False).blocks
            fetch = self.fetches[request.request_id] = TierFetch(request, start=len(hit))
            self._plan_and_fetch(fetch, keys[:limit])

    def _plan_and_fetch(self, fetch: TierFetch, keys: list[bytes]) -> None:
        """The consecutive run through the tiers, the planner's cut, then the reads (fast tiers now)."""
        available = []
        for name, tier in self.tiers.items():
            if self._is_stalled(name):
                break  # a read given up on has not returned: this tier (and the run past it) is out for now
            available.append(tier)
        runs = find_run(available, keys, fetch.start)
        if not runs:
            return
        num_fetch = choose_fetch(self.fetch_policy, runs, self.block_bytes, self.prefill_seconds_per_token,
                                 self.block_size, {tier.name: tier.read_cost for tier in available}
                                 ).num_fetch_blocks_by_tier
        start = fetch.start
        for name, _ in runs:
            count = num_fetch.get(name, 0)
            if not count:
                return  # the planner stops here: what follows is recomputed
            chunk = keys[start:start + count]
            if not self.tiers[name].traits.synchronous:
                fetch.pending, fetch.pending_keys, fetch.pending_start = self.tiers[name].fetch(chunk), chunk, start
                fetch.pending_tier, fetch.pending_since = name, time.perf_counter()
                fetch.request.is_fetching = True
                return
            promoted = self._promote(fetch.request, name, start, chunk, self.tiers[name].get(chunk), time.perf_counter())
            start += promoted
            if promoted < count:
                return

    def _is_stalled(self, name: str) -> bool:
        future = self.stalled.get(name)
        if future is not None and future.done():
            del self.stalled[name]
            future = None
        return future is not None

    def collect(self) -> None:
        """Promote what finished disk reads brought back; their requests may be admitted again. A read
        past the deadline is given up on: its request recomputes."""
        now = time.perf_counter()
        for fetch in list(self.fetches.values()):
            if fetch.pending is None:
                continue
            if not fetch.pending.done():
                if now - fetch.pending_since > self.deadline:
                    self._give_up(fetch)
                continue
            future, fetch.pending = fetch.pending, None
            fetch.request.is_fetching = False
            try:
                encoded = future.result()
            except Exception:  # a tier's bug: recompute
                logger.exception("reading from the %s tier failed; recomputing", fetch.pending_tier)
                continue
            if not fetch.request.is_finished:
                self._promote(fetch.request, fetch.pending_tier, fetch.pending_start, fetch.pending_keys, encoded,
                              fetch.pending_since)

    def _give_up(self, fetch: TierFetch) -> None:
        tier = self.tiers[fetch.pending_tier]
        self.stalled[fetch.pending_tier] = fetch.pending
        fetch.pending.cancel()  # still queued: never runs; running: its result is dropped
        fetch.pending = None
        fetch.request.is_fetching = False
        tier.count_slow_read(self.deadline)

    def wait_for_fetches(self) -> None:
        """Nothing could be scheduled: wait briefly for a disk read instead of spinning."""
        pending = [fetch.pending for fetch in self.fetches.values() if fetch.pending is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=FETCH_WAIT_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def has_pending_fetches(self) -> bool:
        return any(fetch.pending is not None for fetch in self.fetches.values())

    def _promote(self, request: Request, tier_name: str, start: int, keys: list[bytes],
                 encoded: Sequence[Optional[bytes]], began: float) -> int:
        """Verify records for blocks start.. and cache their KV in fresh pool blocks; returns how many.

        Nothing happens (0) unless the request's first `start` blocks are cached on the device now: a
        promoted block must hang from its parent.
        """
        tier, size = self.tiers[tier_name], self.block_size
        prefix = self.cache.match(request.scope_digest, request.block_keys[:start], request.token_ids,
                                  record_stats=False).blocks
        if len(prefix) != start:
            return 0
        payloads = []
        for offset, (key, data) in enumerate(zip(keys, encoded)):
            if data is None:
                break
            index = start + offset
            expect = RecordExpectation(key=key, scope_digest=self.scope_digest,
                                       token_ids=tuple(request.token_ids[index * size:(index + 1) * size]),
                                       dtype=self.dtype, shape=self.shape, tenant_scope=request.block_scope(index))
            try:
                payload = decode_record(data, expect, tier.sealer).payload
                if not payload_is_finite(payload, self.dtype):
                    raise RecordError("nonfinite", "the KV holds NaN or infinity")
            except RecordError as error:
                tier.reject(key, error.reason)
                break
            payloads.append(payload)
        if not payloads:
            return 0
        # Admitting holds the device prefix while allocating, so eviction cannot break the chain under us.
        blocks = self.cache.admit(prefix, len(payloads))
        if blocks is None:
            return 0  # the pool is held by running requests: recompute
        fresh = blocks[start:]
        self.runner.write_blocks([block.block_id for block in fresh], payloads)
        parent = prefix[-1] if prefix else request.scope_digest
        self._promoting_from = tier_name
        try:
            for offset, block in enumerate(fresh):
                index = start + offset
                cached = self.cache.insert(block, keys[offset], request.token_ids[index * size:(index + 1) * size],
                                           parent, scope=request.block_scope(index))
                blocks[start + offset] = cached
                parent = cached
        finally:
            self._promoting_from = None
        self.cache.release(blocks)
        fetch = self.fetches.get(request.request_id)
        if fetch is not None:
            fetch.num_blocks[tier_name] = fetch.num_blocks.get(tier_name, 0) + len(payloads)
        self.hit_tokens[tier_name] += len(payloads) * size
        self.fetch_latency[tier_name].observe(time.perf_counter() - began)
        return len(payloads)

    # ------------------------------------------------------------------ bookkeeping
    def observe_step(self, scheduled, seconds: float) -> None:
        """Learn this engine's prefill cost from steps that were mostly prefill (the planner's other side)."""
        num_tokens = sum(num_new for _, num_new in scheduled)
        if num_tokens >= 64 * len(scheduled):
            per_token = seconds / num_tokens
            self.prefill_seconds_per_token += 0.2 * (per_token - self.prefill_seconds_per_token)

    def tokens_by_tier(self, request: Request) -> dict[str, int]:
        """{"device", "host", "disk", "remote"} tokens of the request's cached prefix (num_cached_tokens is
        their sum)."""
        cached = max(request.num_cached_tokens, 0)
        fetch = self.fetches.get(request.request_id)
        counts = empty_breakdown(cached)
        if fetch is not None:
            for name in self.tiers:  # nearest first
                tokens = min(fetch.num_blocks.get(name, 0) * self.block_size, counts["device"])
                counts[name] = tokens
                counts["device"] -= tokens
        return counts

    def snapshot(self) -> dict[str, "TierSnapshot"]:
        """Per tier: counters, usage, hit tokens and fetch latencies, for metrics (engine thread)."""
        return {name: TierSnapshot(stats=tier.stats, used_bytes=tier.used_bytes, capacity_bytes=tier.capacity_bytes,
                                   hit_tokens=self.hit_tokens[name],
                                   fetch_buckets=self.fetch_latency[name].cumulative(),
                                   fetch_seconds_sum=self.fetch_latency[name].total, rejections=tier.rejections)
                for name, tier in self.tiers.items()}

    def forget(self, request_id: str) -> None:
        fetch = self.fetches.pop(request_id, None)
        if fetch is not None and fetch.pending is not None:
            fetch.pending.cancel()

    def close(self) -> None:
        """Flush what is queued for disk and stop the tiers' threads (a clean shutdown)."""
        for tier in self.tiers.values():
            tier.close()


def empty_breakdown(num_cached_tokens: int) -> dict[str, int]:
    """All cached tokens from the device pool (no tiers, or none of them used)."""
    return {"device": num_cached_tokens, "host": 0, "disk": 0, "remote": 0}


def payload_is_finite(payload: bytes, dtype: str) -> bool:
    """No NaN or infinity in a record's KV: its minimum and maximum in one pass (a NaN propagates into
    both, an infinity is one of them). 3.5 ms for a 2,000-token SmolLM2 prefix (92 MB) here, where
    isfinite().all() took 25 ms building a mask first."""
    if not payload:
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: only read here
        values = torch.frombuffer(payload, dtype=TORCH_DTYPES[dtype])
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def tier_sealer(config) -> Optional[Sealer]:
    """The sealer the configuration's secret file makes (None without one); ValueError names a bad file."""
    if config.kv_tier_secret_file is None:
        return None
    return Sealer(Keyring.from_file(config.kv_tier_secret_file), encrypt=config.kv_tier_encrypt)


def build_tiers(config, scope_digest: bytes) -> list[KVTier]:
    """The tiers the configuration asks for, nearest first: host, disk, remote; each seals its records
    with the fleet's secret when there is one."""
    sealer = tier_sealer(config)
    tiers: list[KVTier] = []
    if config.kv_host_cache_bytes:
        tiers.append(HostTier(config.kv_host_cache_bytes, sealer=sealer))
    if config.kv_disk_cache_dir:
        capacity = config.kv_disk_cache_bytes or DEFAULT_DISK_CACHE_BYTES
        tiers.append(DiskTier(config.kv_disk_cache_dir, capacity, expect_scope=scope_digest, sealer=sealer))
    if config.kv_remote_url:
        from ..tiers.redis import RedisTier  # imports redis only when a remote tier is configured

        if sealer is None:
            logger.warning("remote tier: no --kv-tier-secret-file (--kv-remote-insecure): records are not sealed, "
                           "so anyone who can write %s can change this replica's answers", config.kv_remote_url
                           .rsplit("@", 1)[-1])
        tiers.append(RedisTier(config.kv_remote_url, scope_digest=scope_digest, ttl_seconds=config.kv_remote_ttl,
                               max_write_bytes_per_second=config.kv_remote_write_bytes_per_second,
                               read_timeout=config.kv_remote_timeout, sealer=sealer))
    return tiers
