"""The system-prompt scenario from the issue, at the default block size of 16."""

import random

from cache_helpers import FakeRequest, admit, finish, insert_full_blocks

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache

SCOPE = CacheScope("model", "tokenizer")


def tokens(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(8192) for _ in range(n)]


def test_system_prompt_then_new_question_matches_125_blocks():
    cache, keyer = RadixCache(1000, 16), BlockKeyer(16)
    system = tokens(0, 2000)
    first = admit(cache, keyer, FakeRequest(system + tokens(1, 18), SCOPE.digest), num_output_slots=32)
    insert_full_blocks(cache, first)
    finish(cache, first)
    free_before = cache.pool.num_free_blocks
    second = admit(cache, keyer, FakeRequest(system + tokens(2, 25), SCOPE.digest), num_output_slots=32)
    assert second.num_cached_tokens == 2000
    assert len(second.blocks) - 125 == 4  # ceil((2025 + 32) / 16) = 129 blocks, 125 of them reused
    assert free_before - cache.pool.num_free_blocks == 4
    assert cache.stats.num_hit_tokens == 2000 and cache.stats.num_queries == 2
    cache.check_integrity()


def test_fully_cached_prompt_recomputes_its_last_block():
    cache, keyer = RadixCache(1000, 16), BlockKeyer(16)
    prompt = tokens(3, 2000)
    finish(cache, insert_and_return(cache, keyer, prompt))
    again = admit(cache, keyer, FakeRequest(prompt, SCOPE.digest))
    assert again.num_cached_tokens == 124 * 16
    assert len(again.blocks) == 125
    cache.check_integrity()


def insert_and_return(cache, keyer, prompt):
    request = admit(cache, keyer, FakeRequest(prompt, SCOPE.digest))
    insert_full_blocks(cache, request)
    return request
