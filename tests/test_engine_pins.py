"""Pinning in the engine: the hot-prefix policy, operator pins with a TTL, pins across restarts and reloads."""

import pytest
from conftest import make_llm

SYSTEM = "You are the assistant of the pinning tests; keep every answer short and polite. " * 4
POOL = (
    48 * 16 * 16384
)  # 48 blocks of 16 tokens (16 KiB a token in fp32 for the built-in model): a flood evicts everything unpinned
GREEDY = dict(temperature=0.0, max_tokens=2, ignore_eos=True)


def params():
    from prefixserve import SamplingParams

    return SamplingParams(**GREEDY)


def one_off(index: int) -> str:
    return f"one-off prompt number {index} about topic {index * 7919 % 1000}: " + "lorem ipsum dolor " * 12


def flood(llm, count: int = 16) -> None:  # about 70 blocks through a pool of 48
    for start in range(0, count, 4):
        llm.generate([one_off(index) for index in range(start, start + 4)], params())


def system_hit_tokens(llm) -> int:
    return llm.generate(SYSTEM + "Final question?", params())[0].num_cached_tokens


def num_system_blocks(llm) -> int:
    return len(llm.tokenizer.encode(SYSTEM)) // 16


def test_a_hot_system_prompt_is_pinned_and_survives_a_flood_of_one_off_prompts():
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=3, hot_prefix_window=600)
    for index in range(4):  # the first computes it, the next three reuse it: hot
        llm.generate(SYSTEM + f"Question {index}?", params())
    llm.engine.hot_prefixes.tick(llm.engine.cache, force=True)
    assert llm.engine.cache.usage().num_pinned_blocks >= num_system_blocks(llm) - 1
    flood(llm)
    assert system_hit_tokens(llm) >= (num_system_blocks(llm) - 1) * 16
    llm.engine.cache.check_integrity()


def test_without_the_policy_the_same_flood_evicts_the_system_prompt():
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0)
    for index in range(4):
        llm.generate(SYSTEM + f"Question {index}?", params())
    flood(llm)
    assert system_hit_tokens(llm) == 0


def test_a_cooled_prefix_is_unpinned_and_policy_pins_give_way_to_a_request_that_needs_the_room():
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=3, hot_prefix_window=600)
    clock = [0.0]
    policy = llm.engine.hot_prefixes
    policy.clock = lambda: clock[0]
    for index in range(4):  # a miss, then three reuses
        llm.generate(SYSTEM + f"Question {index}?", params())
    policy.tick(llm.engine.cache, force=True)
    assert policy.num_pinned_blocks > 0
    clock[0] += 601  # the window passes with no reuse: it cooled
    policy.tick(llm.engine.cache, force=True)
    assert policy.num_pinned_blocks == 0 and llm.engine.cache.usage().num_pinned_blocks == 0
    for index in range(3):  # cached already: three reuses
        llm.generate(SYSTEM + f"Again {index}?", params())
    policy.tick(llm.engine.cache, force=True)
    assert policy.num_pinned_blocks > 0
    longest = [1] * (llm.engine.cache.pool.num_blocks * 16 - 8)  # needs nearly every block of the pool
    out = llm.generate({"prompt_token_ids": longest}, params())[0]
    assert out.finish_reason == "length" and policy.num_pinned_blocks == 0
    llm.engine.cache.check_integrity()


def test_an_operator_pin_holds_through_a_flood_until_its_ttl_ends():
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0)
    now = [1_000_000.0]
    llm.engine.pins.wall_clock = lambda: now[0]
    pin = llm.pin(SYSTEM, ttl=30)
    assert pin["num_blocks"] == num_system_blocks(llm) and pin["expires_at"] == now[0] + 30
    assert "token_ids" not in pin
    flood(llm)
    assert system_hit_tokens(llm) == num_system_blocks(llm) * 16
    now[0] += 31
    flood(llm)  # the pin expired at the first step; the flood evicts the prefix now
    assert llm.pins() == []
    assert system_hit_tokens(llm) == 0
    llm.engine.cache.check_integrity()


def test_pins_are_listed_and_removed_and_bad_pins_name_the_fix():
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0)
    pin = llm.pin(SYSTEM)
    assert [entry["id"] for entry in llm.pins()] == [pin["id"]] and pin["expires_at"] is None
    assert llm.unpin(pin["id"]) and not llm.unpin(pin["id"])
    assert llm.engine.cache.usage().num_pinned_blocks == 0
    with pytest.raises(ValueError, match="less than one block"):
        llm.pin("short")
    with pytest.raises(ValueError, match="ttl"):
        llm.pin(SYSTEM, ttl=-1)
    small = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0, max_pinned_blocks=2)
    with pytest.raises(ValueError, match="max_pinned_blocks"):
        small.pin(SYSTEM)


def test_pins_survive_a_restart_with_a_disk_tier(tmp_path):
    options = dict(
        kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0, kv_disk_cache_dir=str(tmp_path), kv_fetch_policy="always"
    )  # warmed from disk whatever this machine's read and prefill times
    first = make_llm(**options)
    pin = first.pin(SYSTEM)
    first.close()
    del first
    restarted = make_llm(**options)
    assert [entry["id"] for entry in restarted.pins()] == [pin["id"]]
    assert restarted.engine.cache.usage().num_pinned_blocks == pin["num_blocks"]
    assert restarted.engine.tiers.reader.hit_tokens["disk"] > 0  # warmed from disk, not recomputed
    flood(restarted)
    assert system_hit_tokens(restarted) == pin["num_blocks"] * 16
    assert restarted.unpin(pin["id"])
    restarted.close()
    assert make_llm(**options).pins() == []  # an unpin is saved too


def test_a_reload_pins_again_on_the_new_version(default_model_dir):
    llm = make_llm(kv_cache_memory_bytes=POOL, hot_prefix_min_requests=0)
    pin = llm.pin(SYSTEM)
    report = llm.reload(None)  # same checkpoint path: new weights would do the same
    assert report.num_restored_pins == 1
    assert llm.engine.cache.usage().num_pinned_blocks == pin["num_blocks"]
    assert [entry["id"] for entry in llm.pins()] == [pin["id"]]
