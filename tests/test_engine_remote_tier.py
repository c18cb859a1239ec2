"""The remote tier in the engine: one engine computes, a fresh one (another replica) is served from Redis
with identical greedy tokens; a damaged value or a dead Redis means recompute, never an error."""

import random

from conftest import make_llm

from prefixserve import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX_LEN = 256


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(PREFIX_LEN)] + [5, 6, 7] for _ in range(count)]


def run(llm, batch):
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in batch]


def test_another_engine_is_served_from_redis_with_the_same_tokens(shared_redis, tier_secret_file):
    batch = prompts(0)
    writer = make_llm(kv_remote_url=shared_redis.url, kv_tier_secret_file=tier_secret_file)
    expected = [out.token_ids for out in run(writer, batch)]
    writer.engine.tiers.tiers["remote"].flush()
    # another replica, nothing in its own pool; every remote hit fetched, so the counts below do not hang on
    # how fast this machine reads Redis against how fast it prefills (the default planner weighs both)
    reader = make_llm(kv_remote_url=shared_redis.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    outputs = run(reader, batch)
    assert [out.token_ids for out in outputs] == expected
    assert [out.cached_tokens_by_tier["remote"] for out in outputs] == [PREFIX_LEN] * len(batch)
    assert reader.engine.tiers.tiers["remote"].stats.hits == len(batch) * PREFIX_LEN // 16


def test_a_damaged_value_or_a_dead_redis_means_recompute(shared_redis, tier_secret_file):
    batch = prompts(1)
    writer = make_llm(kv_remote_url=shared_redis.url, kv_tier_secret_file=tier_secret_file)
    expected = [out.token_ids for out in run(writer, batch)]
    writer.engine.tiers.tiers["remote"].flush()
    client = shared_redis.client()
    first_key = sorted(client.keys("pskv:*"))[0]
    client.set(first_key, client.get(first_key)[:-10])  # truncated in place
    # every remote run fetched: the default planner may recompute a run on a loaded machine, never reading the damage
    reader = make_llm(kv_remote_url=shared_redis.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    assert [out.token_ids for out in run(reader, batch)] == expected
    assert reader.engine.tiers.tiers["remote"].stats.rejected_records >= 1
    shared_redis.kill()
    cold = make_llm(kv_remote_url=shared_redis.url, kv_tier_secret_file=tier_secret_file, kv_remote_timeout=0.3)
    outputs = run(cold, prompts(2))
    reference = make_llm(enable_prefix_caching=False)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in run(reference, prompts(2))]
    assert all(out.cached_tokens_by_tier["remote"] == 0 for out in outputs)
