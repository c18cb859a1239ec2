"""The KV hierarchy in the engine: a prefix served from host RAM, from disk, after a restart, or
recomputed gives the same greedy tokens; exact per-tier counts; damaged records are recomputed."""

import random

import conftest
import pytest
from model_helpers import write_qwen2_checkpoint

from prefixserve import SamplingParams
from prefixserve.tiers.disk_files import record_path
from prefixserve.tiers.record import BlockRecord, RecordExpectation, decode_record, encode_record, read_header

PREFIX_LEN = 512  # 32 blocks of 16
NUM_PREFIXES = 12
POOL = 28 << 20  # 112 blocks of the built-in model in fp32: 3 of these prompts (33 blocks each) fit, not 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ALL_FROM = {tier: {"device": 0, "host": 0, "disk": 0, "remote": 0, tier: PREFIX_LEN} for tier in ("host", "disk")}


SECOND_PREFIX_LEN = 256  # the second checkpoint has 512 positions


def make_llm(**options):
    """Every lower-tier hit fetched: the default planner ("cost") learns read and prefill times from this
    machine, so on a slow one it may rightly recompute a short run, and exact per-tier counts would depend
    on speed. The planner's own decisions are tested in test_tiers_policy.py and at the end of this file."""
    options.setdefault("kv_fetch_policy", "always")
    return conftest.make_llm(**options)


def make_prompts(seed: int = 0, prefix_len: int = PREFIX_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(prefix_len)] + [7, 8, 9] for _ in range(NUM_PREFIXES)]


def run(llm, prompts):
    """One request at a time, so the order in which blocks leave the pool is fixed."""
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def reference():
    prompts = make_prompts()
    llm = make_llm(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    return prompts, [out.token_ids for out in run(llm, prompts)]


def test_host_tier_serves_a_working_set_four_times_the_pool(reference):
    prompts, expected = reference
    llm = make_llm(kv_cache_memory_bytes=POOL, kv_host_cache_bytes=512 << 20)
    first = run(llm, prompts)
    assert [out.token_ids for out in first] == expected
    assert all(out.cached_tokens_by_tier["host"] == 0 for out in first)
    second = run(llm, prompts)  # every prefix left the pool before its turn came back
    assert [out.token_ids for out in second] == expected
    assert [out.cached_tokens_by_tier for out in second] == [ALL_FROM["host"]] * NUM_PREFIXES
    assert [out.num_cached_tokens for out in second] == [PREFIX_LEN] * NUM_PREFIXES
    llm.engine.cache.check_integrity()
    llm.engine.tiers["host"].check_integrity()


def test_a_burst_larger_than_the_pool_is_still_served_from_host(reference):
    """Submitted at once, prefixes are brought back only for requests near the head of the queue, so
    the burst's own promotions do not evict one another before admission."""
    prompts, expected = reference
    llm = make_llm(kv_cache_memory_bytes=POOL, kv_host_cache_bytes=512 << 20)
    run(llm, prompts)
    burst = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in burst] == expected
    assert [out.cached_tokens_by_tier for out in burst] == [ALL_FROM["host"]] * NUM_PREFIXES
    llm.engine.cache.check_integrity()


def test_host_and_disk_together_reach_the_disk_past_an_empty_host_run(reference, tmp_path):
    prompts, expected = reference
    llm = make_llm(
        kv_cache_memory_bytes=POOL,
        kv_host_cache_bytes=3 * 34 * (256 << 10),  # 3 prompts' worth
        kv_disk_cache_dir=str(tmp_path),
    )
    run(llm, prompts)
    second = run(llm, prompts)
    assert [out.token_ids for out in second] == expected
    assert [out.num_cached_tokens for out in second] == [PREFIX_LEN] * NUM_PREFIXES
    assert sum(out.cached_tokens_by_tier["disk"] for out in second) > 0


def test_disk_tier_serves_after_eviction_and_after_a_restart(reference, tmp_path):
    prompts, expected = reference
    llm = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    assert [out.token_ids for out in run(llm, prompts)] == expected
    second = run(llm, prompts)
    assert [out.token_ids for out in second] == expected
    assert [out.cached_tokens_by_tier for out in second] == [ALL_FROM["disk"]] * NUM_PREFIXES
    llm.close()
    del llm
    restarted = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    report = restarted.engine.tiers["disk"].rebuild_report
    assert report.num_records > 0 and report.num_rejected == 0
    first = run(restarted, prompts[:3])  # its very first requests hit from disk
    assert [out.token_ids for out in first] == expected[:3]
    assert [out.cached_tokens_by_tier for out in first] == [ALL_FROM["disk"]] * 3
    restarted.engine.tiers["disk"].check_integrity()


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory):
    return write_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2-tiers"), seed=5)


def test_another_model_finds_nothing_and_reclaims_the_old_records(reference, second_checkpoint, tmp_path):
    prompts = make_prompts(seed=2, prefix_len=SECOND_PREFIX_LEN)[:2]
    llm = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    run(llm, prompts)
    llm.close()
    del llm
    other = make_llm(model=str(second_checkpoint), kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    assert other.engine.tiers["disk"].rebuild_report.num_reclaimed > 0
    assert other.engine.tiers["disk"].keys() == []
    assert all(out.num_cached_tokens == 0 for out in run(other, prompts))


def test_a_second_checkpoint_gives_the_same_tokens_from_every_tier(second_checkpoint, tmp_path):
    prompts = make_prompts(seed=1, prefix_len=SECOND_PREFIX_LEN)[:5]
    plain = make_llm(model=str(second_checkpoint), kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    expected = [out.token_ids for out in run(plain, prompts)]
    tiered = make_llm(
        model=str(second_checkpoint),
        kv_cache_memory_bytes=POOL,
        kv_host_cache_bytes=256 << 20,
        kv_disk_cache_dir=str(tmp_path),
    )
    assert [out.token_ids for out in run(tiered, prompts)] == expected
    again = run(tiered, prompts)
    assert [out.token_ids for out in again] == expected
    assert all(out.num_cached_tokens == SECOND_PREFIX_LEN for out in again)
    assert {tier for out in again for tier, tokens in out.cached_tokens_by_tier.items() if tokens} <= {"device", "host"}
    tiered.close()
    del tiered
    restarted = make_llm(model=str(second_checkpoint), kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    from_disk = run(restarted, prompts)
    assert [out.token_ids for out in from_disk] == expected
    assert [out.cached_tokens_by_tier["disk"] for out in from_disk] == [SECOND_PREFIX_LEN] * len(prompts)


def _first_keys(llm, prompt, count):
    request = llm.engine.make_request(prompt)
    return llm.engine.keyer.keys(request.scope_digest, prompt)[:count]


def test_damaged_and_foreign_records_are_recomputed_and_counted(reference, tmp_path):
    prompts, expected = reference
    llm = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    run(llm, prompts[:3])
    keys = [_first_keys(llm, prompt, 4) for prompt in prompts[:3]]
    llm.close()
    del llm
    flipped = record_path(tmp_path, keys[0][2])  # a payload byte flipped: caught by the checksum on read
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = record_path(tmp_path, keys[1][1])  # cut short, as by a crash
    truncated.write_bytes(truncated.read_bytes()[:5000])
    foreign = record_path(tmp_path, keys[2][0])  # the same key, another scope's record copied in
    data = foreign.read_bytes()
    header = read_header(data)
    record = decode_record(data, RecordExpectation(header.key, None, None, header.dtype, header.shape))
    foreign.write_bytes(
        encode_record(
            BlockRecord(
                record.key,
                record.parent_key,
                b"another model's scope".ljust(32, b"!"),
                record.token_ids,
                record.dtype,
                record.shape,
                record.payload,
            )
        )
    )
    restarted = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    outputs = run(restarted, prompts[:3])
    assert [out.token_ids for out in outputs] == expected[:3]
    assert [out.cached_tokens_by_tier["disk"] for out in outputs] == [2 * 16, 1 * 16, 0]  # up to the damage
    disk = restarted.engine.tiers["disk"]
    report, stats = disk.rebuild_report, disk.stats
    assert report.num_rejected == 1  # the truncated record, at start-up
    assert stats.rejected_records == 2  # ...and the flipped one, on read
    assert report.num_reclaimed == stats.reclaimed_records == 1  # the foreign one, at start-up
    disk.check_integrity()


def test_a_disk_too_small_or_unusable_never_reaches_the_client(reference, tmp_path):
    prompts, expected = reference
    tiny = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path / "tiny"), kv_disk_cache_bytes=1 << 20)
    assert [out.token_ids for out in run(tiny, prompts[:4] * 2)] == expected[:4] * 2
    tiny.close()
    assert tiny.engine.tiers["disk"].stats.dropped_puts + tiny.engine.tiers["disk"].stats.evictions > 0
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    unusable = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(blocked / "kv"))
    assert [out.token_ids for out in run(unusable, prompts[:2])] == expected[:2]
    unusable.close()
    assert unusable.engine.tiers["disk"].stats.errors > 0


WRITER = """
import random, sys
from prefixserve import LLM, SamplingParams
llm = LLM(dtype="float32", kv_cache_memory_bytes={pool}, kv_disk_cache_dir=sys.argv[1], log_stats=False)
rng = random.Random(0)
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
for index in range(200):  # bounded: the test kills it long before
    llm.generate([[rng.randrange(10, 8000) for _ in range({prefix_len})] + [7, 8, 9]], params, use_tqdm=False)
    print(index, flush=True)
"""


def test_a_process_killed_mid_write_leaves_a_directory_the_next_one_serves(reference, tmp_path):
    import os
    import subprocess
    import sys

    prompts, expected = reference
    script = WRITER.format(pool=POOL, prefix_len=PREFIX_LEN)
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        for _ in range(4):  # a few prompts done, their writes (and the next ones') in flight
            assert writer.stdout.readline(), "the writer died before it wrote anything"
    finally:
        writer.kill()  # SIGKILL: no flush, no clean close
        writer.wait(timeout=30)
    restarted = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    report = restarted.engine.tiers["disk"].rebuild_report
    assert report.num_records > 0  # what was on disk before the kill is served
    outputs = run(restarted, prompts[:4])  # the writer's first prompts are these (same seed)
    assert [out.token_ids for out in outputs] == expected[:4]
    assert sum(out.cached_tokens_by_tier["disk"] for out in outputs) > 0
    restarted.engine.tiers["disk"].check_integrity()


def test_kv_events_carry_each_tiers_medium(reference, tmp_path):
    from prefixserve.cache import BlockRemoved, BlockStored

    prompts, _ = reference
    llm = make_llm(
        kv_cache_memory_bytes=POOL,
        kv_host_cache_bytes=2 * 34 * (256 << 10),  # 2 prompts' worth
        kv_disk_cache_dir=str(tmp_path),
        enable_kv_events=True,
    )
    run(llm, prompts[:6])
    llm.engine.tiers["disk"].flush()  # the background writes are on disk (and their events published)
    events, _, _ = llm.engine.events.since(0)
    media = {(type(event).__name__, event.medium) for event in events if isinstance(event, (BlockStored, BlockRemoved))}
    assert {
        ("BlockStored", "GPU"),
        ("BlockRemoved", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "CPU"),
        ("BlockStored", "DISK"),
    } <= media
    held = {medium: set(keys) for medium, keys in llm.engine.tiers.tier_keys().items()}
    mirrored = {"CPU": set(), "DISK": set()}
    for event in events:
        if isinstance(event, BlockStored) and event.medium in mirrored:
            mirrored[event.medium].update(event.keys)
        elif isinstance(event, BlockRemoved) and event.medium in mirrored:
            mirrored[event.medium].difference_update(event.keys)
    assert mirrored == held  # the events alone rebuild what each tier holds
    llm.close()


def test_the_cost_planner_recomputes_a_run_it_prices_above_prefill(reference, tmp_path):
    """kv_fetch_policy="cost" (the default) with a disk priced at an hour a read: nothing is fetched, the same
    tokens come out, and the disk is never asked; "always" fetches the same records."""
    from prefixserve.tiers import TierCost

    prompts, expected = reference
    llm = conftest.make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    assert llm.engine.config.kv_fetch_policy == "cost"
    disk = llm.engine.tiers["disk"]
    disk.read_cost = TierCost(latency_seconds=3600.0, bytes_per_second=1.0)  # never observed: it is never read
    run(llm, prompts[:4])
    second = run(llm, prompts[:4])  # prompt 0 left the pool for prompt 3: its run is on disk only
    assert [out.token_ids for out in second] == expected[:4]
    assert [out.cached_tokens_by_tier["disk"] for out in second] == [0] * 4
    assert disk.contains(_first_keys(llm, prompts[0], 32)) == 32 and disk.stats.hits == disk.stats.misses == 0
    llm.close()
    always = make_llm(kv_cache_memory_bytes=POOL, kv_disk_cache_dir=str(tmp_path))
    always.engine.tiers["disk"].read_cost = TierCost(latency_seconds=3600.0, bytes_per_second=1.0)
    assert [out.cached_tokens_by_tier["disk"] for out in run(always, prompts[:1])] == [PREFIX_LEN]
