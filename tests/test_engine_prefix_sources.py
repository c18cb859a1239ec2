"""Admission asks one interface where a waiting request's prefix is held: the device radix, then each tier.

PrefixSources.find answers blocks per source (nearest first, each continuing where the one before stopped) and
what the planner reads back at what estimated cost; ready_prefix loads a synchronous tier's blocks at once and
parks a request on an asynchronous tier's read in RequestStatus.WAITING_FOR_KV, which the scheduler passes over.
"""

import random
import time

import conftest

from prefixserve import SamplingParams
from prefixserve.cache import BlockKeyer, RadixCache
from prefixserve.engine.prefix_sources import NO_LOWER_TIERS, PrefixSources
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.request_windows import RequestWindows

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
POOL = 28 << 20  # 112 blocks of the built-in model in fp32: three 33-block prompts fit, not four


def prompts(count=5, prefix_len=512, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(prefix_len)] + [7, 8, 9] for _ in range(count)]


def waiting(llm, tokens: list[int], name: str) -> Request:
    """A request as the engine would queue it, not yet submitted."""
    return llm.engine.make_request({"prompt_token_ids": tokens}, GREEDY, request_id=name)


def evicted(llm, batch):
    """Run `batch` one at a time, then enough others that the first left the pool (into the tiers)."""
    for tokens in batch:
        llm.generate([tokens], GREEDY, use_tqdm=False)


def test_find_names_each_source_and_its_cost():
    llm = conftest.make_llm(kv_cache_memory_bytes=POOL, kv_host_cache_bytes=512 << 20, kv_fetch_policy="always")
    batch = prompts()
    evicted(llm, batch)
    sources = llm.engine.scheduler.sources
    found = sources.find(waiting(llm, batch[0], "a"))  # batch[0] left the pool for host RAM
    assert found.device == [] and [run.source for run in found.lower] == ["host"]
    assert found.lower[0].num_blocks == found.lower[0].num_chosen == 512 // 16
    assert found.blocks_by_source() == {"device": 0, "host": 32} and found.fetch_seconds > 0
    again = sources.find(waiting(llm, batch[-1], "b"))  # the newest is still on the device
    assert len(again.device) == 32 and again.lower == []
    assert sources.find(waiting(llm, batch[0], "a")).lower == []  # a request is asked of the tiers once


def test_a_synchronous_tier_loads_at_once_and_admission_takes_the_device_blocks():
    llm = conftest.make_llm(kv_cache_memory_bytes=POOL, kv_host_cache_bytes=512 << 20, kv_fetch_policy="always")
    batch = prompts()
    evicted(llm, batch)
    request = waiting(llm, batch[0], "a")
    hit = llm.engine.scheduler.sources.ready_prefix(request)
    assert len(hit) == 32 and request.status is RequestStatus.WAITING
    llm.engine.cache.check_integrity()


def test_an_asynchronous_read_parks_the_request_and_others_pass_it(tmp_path):
    llm = conftest.make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path), kv_fetch_policy="always")
    batch = prompts()
    evicted(llm, batch)
    disk = llm.engine.tiers["disk"]
    disk.flush()
    real_fetch, release = disk.fetch, []

    def held_fetch(keys):  # the read does not come back until the test lets it
        future = real_fetch(keys)
        release.append(future)
        return _Held(future)

    disk.fetch = held_fetch
    scheduler = llm.engine.scheduler
    parked = waiting(llm, batch[0], "parked")
    fresh = waiting(llm, [5] * 40, "fresh")
    llm.engine.submit(parked)
    llm.engine.submit(fresh)
    output = scheduler.schedule()
    assert parked.status is RequestStatus.WAITING_FOR_KV
    assert [scheduled.request.request_id for scheduled in output.scheduled] == ["fresh"]
    _Held.open = True
    deadline = time.monotonic() + 30
    while parked.status is RequestStatus.WAITING_FOR_KV and time.monotonic() < deadline:
        scheduler.sources.collect()
        time.sleep(0.01)
    assert parked.status is RequestStatus.WAITING and release
    hit = scheduler.sources.ready_prefix(parked)
    assert len(hit) == 32  # what the disk read brought back now hangs in the device radix
    llm.engine.cache.check_integrity()


class _Held:
    """A future that reports not done until the test opens it."""

    open = False

    def __init__(self, future) -> None:
        self.future = future

    def done(self) -> bool:
        return _Held.open and self.future.done()

    def result(self, timeout=None):
        return self.future.result(timeout)

    def cancel(self) -> bool:
        return self.future.cancel()


def test_a_pool_with_nothing_below_it_finds_the_device_alone():
    cache = RadixCache(16, 4)
    sources = PrefixSources(cache, BlockKeyer(4), RequestWindows(None))
    assert sources.lower is NO_LOWER_TIERS
    request = Request("r", list(range(10, 30)), GREEDY, b"\x00" * 32)
    found = sources.find(request)
    assert found.device == [] and found.lower == [] and found.num_chosen_blocks == 0
    assert sources.ready_prefix(request) == []
    sources.collect()
    sources.wait_for_reads()  # nothing pending: returns at once
