"""Privacy mode: a request (cache_retention) or a tenant (its keys-file entry) says its KV never leaves
device memory ("device") or is not kept after the request at all ("none"). Checked by reading every
tier (host, disk, Redis) and the KV events after such requests, with a pool small enough that their
blocks are evicted (where the host tier would catch them) and a normal request beside them as control."""

from __future__ import annotations

import random

import pytest
from conftest import make_llm

from prefixserve import SamplingParams
from prefixserve.cache.events import BlockStored
from prefixserve.engine.input_processor import stricter_retention
from prefixserve.tiers import read_header

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX_LEN = 320  # 20 blocks


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(PREFIX_LEN)] + [5, 6, 7]


def blocks_of(tokens: list[int]) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + 16]) for i in range(0, len(tokens) - 15, 16)}


def tier_token_blocks(llm, redis_client) -> dict[str, set]:
    tiers = llm.engine.tiers
    for tier in tiers.tiers.values():
        tier.flush()
    held = {}
    for name, tier in tiers.tiers.items():
        records = [data for data in tier.get(tier.keys()) if data is not None]
        held[name] = {read_header(data).token_ids for data in records}
    held["redis-raw"] = {read_header(redis_client.get(name)).token_ids for name in redis_client.keys("pskv:*")}
    return held


def test_device_and_none_requests_leave_nothing_in_any_tier_or_event(tmp_path, redis_server, tier_secret_file):
    reference = make_llm(enable_prefix_caching=False)
    private, ephemeral, normal = prompt(1), prompt(2), prompt(3)
    expected = [out.token_ids for out in reference.generate([private, ephemeral, normal], GREEDY, use_tqdm=False)]
    llm = make_llm(
        kv_cache_memory_bytes=12 << 20,  # 48 blocks: each prompt (21) evicts the one before
        kv_host_cache_bytes=64 << 20,
        kv_disk_cache_dir=str(tmp_path),
        kv_remote_url=redis_server.url,
        kv_tier_secret_file=tier_secret_file,
        enable_kv_events=True,
        kv_fetch_policy="always",
    )
    outs = llm.generate(
        [
            {"prompt_token_ids": private, "cache_retention": "device"},
            {"prompt_token_ids": ephemeral, "cache_retention": "none"},
            normal,
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [out.token_ids for out in outs] == expected
    again = llm.generate(
        [{"prompt_token_ids": private, "cache_retention": "device"}, normal, normal], GREEDY, use_tqdm=False
    )  # evicts the private prompt's blocks past the host tier
    assert [out.token_ids for out in again] == [expected[0], expected[2], expected[2]]
    held = tier_token_blocks(llm, redis_server.client())
    for name, blocks in held.items():
        assert not blocks & blocks_of(private), f"a device-only block reached the {name} tier"
        assert not blocks & blocks_of(ephemeral), f"a retention-none block reached the {name} tier"
    assert blocks_of(normal) <= held["disk"] and blocks_of(normal) <= held["remote"]  # the tiers do work
    events, _, _ = llm.engine.events.since(0)
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert not [e for e in stored if blocks_of(e.token_ids) & blocks_of(ephemeral)]  # never stored anywhere
    private_keys = {
        key
        for e in stored
        if e.medium in (None, "GPU") and blocks_of(e.token_ids) & blocks_of(private)
        for key in e.keys
    }
    assert private_keys  # it was cached on the device (and its second run hit it there or recomputed)
    assert not [e for e in stored if e.medium in ("CPU", "DISK") and set(e.keys) & private_keys]


def test_the_stricter_retention_wins_and_bad_values_are_refused():
    assert stricter_retention(None, "device") == "device"
    assert stricter_retention("device", "none") == "none" and stricter_retention("none", None) == "none"
    assert stricter_retention(None, None) is None
    with pytest.raises(ValueError, match="cache_retention must be one of"):
        stricter_retention("forever")
    llm = make_llm()
    with pytest.raises(ValueError, match="cache_retention"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_retention": "disk"}], GREEDY, use_tqdm=False)
