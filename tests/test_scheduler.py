"""The scheduler alone (no torch, no model): budgets, chunking, admission, preemption, cache use."""

from prefixserve.cache import BlockKeyer, CacheScope, RadixCache
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.sampling_params import SamplingParams
from prefixserve.engine.scheduler import Scheduler

SCOPE = CacheScope("model", "tokenizer").digest
BS = 4


def make(num_blocks=32, budget=16, max_num_seqs=8, caching=True, policy="fcfs"):
    cache = RadixCache(num_blocks, BS)
    return Scheduler(
        cache,
        BlockKeyer(BS),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        policy=policy,
    )


def request(name, tokens, max_tokens=4):
    return Request(name, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), SCOPE)


def step(scheduler, token=7):
    """One step with a fake model that samples `token` wherever logits exist."""
    out = scheduler.schedule()
    plan = [(item.request.request_id, item.num_new_tokens) for item in out.scheduled]
    sampled = [
        token if item.request.num_computed_tokens + item.num_new_tokens == item.request.num_tokens else None
        for item in out.scheduled
    ]
    scheduler.update(out, sampled)
    scheduler.cache.check_integrity()
    return plan, out


def test_chunked_prefill_shares_the_token_budget_and_decodes_go_first():
    s = make(budget=16)
    a, b = request("a", range(100, 110)), request("b", range(200, 230))
    s.add_request(a)
    s.add_request(b)
    assert step(s)[0] == [("a", 10), ("b", 6)]  # a whole, b's first chunk
    assert step(s)[0] == [("a", 1), ("b", 15)]  # a decodes first, b takes the rest
    assert step(s)[0] == [("a", 1), ("b", 9)]  # b's prompt completes: it samples
    assert b.num_output_tokens == 1 and a.num_output_tokens == 3
    assert step(s)[0] == [("a", 1), ("b", 1)]
    assert a.is_finished and a.finish_reason == "length" and a.blocks == []


def test_max_num_seqs_caps_the_running_batch():
    s = make(max_num_seqs=2, budget=64)
    for name in "abc":
        s.add_request(request(name, range(5)))
    plan, _ = step(s)
    assert [name for name, _ in plan] == ["a", "b"]
    assert len(s.waiting) == 1


def test_admission_counts_cache_hits_before_asking_for_blocks():
    s = make(num_blocks=32, budget=64)
    first = request("first", range(20))
    s.add_request(first)
    while not first.is_finished:
        step(s)
    second = request("second", list(range(20)) + [99, 98])
    s.add_request(second)
    plan, _ = step(s)
    assert plan == [("second", 2)]  # first's 5 prompt blocks (20 tokens) cached, 2 computed
    assert second.num_cached_tokens == 20
    assert s.cache.stats.num_hit_tokens == 20 and s.cache.stats.num_queries == 2


def test_caching_off_never_matches_or_inserts():
    s = make(caching=False, budget=64)
    for name in ("x", "y"):
        r = request(name, range(20))
        s.add_request(r)
        while not r.is_finished:
            step(s)
        assert r.num_cached_tokens == 0
    assert s.cache.num_cached_blocks == 0


def test_newest_request_is_preempted_and_recomputes_from_its_cached_blocks():
    s = make(num_blocks=8, budget=64)
    old, new = request("old", range(100, 115), max_tokens=8), request("new", range(200, 215), max_tokens=8)
    s.add_request(old)
    s.add_request(new)
    step(s)  # both prefilled: 4 blocks each, the pool is full
    plan, out = step(s)  # token 16 of each fits in its 4th block
    assert plan == [("old", 1), ("new", 1)] and not out.preempted
    plan, out = step(s)  # both need a 5th block: none is free, nothing is evictable
    assert plan == [("old", 1)]
    assert [r.request_id for r in out.preempted] == ["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and new.blocks == []
    assert s.num_preemptions == 1
    while not old.is_finished:
        step(s)
    plan, _ = step(s)
    # new comes back: its prompt blocks were cached before preemption, and survive if not evicted
    assert plan[0][0] == "new" and new.num_computed_tokens > plan[0][1]
    while not new.is_finished:
        step(s)
    assert new.num_output_tokens == 8
    assert s.cache.usage().num_referenced_blocks == 0


def test_lpm_admits_the_longest_cached_prefix_first():
    s = make(budget=64, max_num_seqs=1, policy="lpm")
    warm = request("warm", range(30))
    s.add_request(warm)
    while not warm.is_finished:
        step(s)
    s.add_request(request("cold", range(500, 530)))
    s.add_request(request("hot", list(range(30)) + [1]))
    plan, _ = step(s)
    assert plan[0][0] == "hot"


def test_prompt_larger_than_the_whole_pool_is_rejected():
    s = make(num_blocks=4)
    try:
        s.add_request(request("huge", range(40)))
    except ValueError as error:
        assert "needs 11 KV blocks but the pool has 4" in str(error)
    else:
        raise AssertionError("a prompt larger than the pool must be rejected")


def test_abort_frees_blocks():
    s = make(budget=64)
    r = request("r", range(30), max_tokens=100)
    s.add_request(r)
    step(s)
    assert s.abort_request("r") is r
    assert r.finish_reason == "abort" and s.cache.usage().num_referenced_blocks == 0
    assert s.abort_request("r") is None


def run(scheduler, max_steps=50):
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return
        step(scheduler)
    raise AssertionError("the scheduler spins: requests never finish")


def pinned_pool(num_pinned_blocks):
    """8 blocks of 4 tokens, `num_pinned_blocks` of them held by a pinned cached prefix."""
    s = make(num_blocks=8, budget=64)
    cache = s.cache
    cache.pins.max_blocks = num_pinned_blocks
    owner = request("owner", range(500, 500 + 4 * num_pinned_blocks + 1), max_tokens=1)
    s.add_request(owner)
    run(s)
    assert cache.pin(owner.block_keys[:num_pinned_blocks]) == num_pinned_blocks
    return s


def test_a_running_request_that_cannot_grow_even_alone_finishes_with_length():
    s = pinned_pool(3)  # 5 blocks left: 20 tokens at most
    r = request("r", range(100, 112), max_tokens=20)  # would need 8 blocks at 32 tokens
    s.add_request(r)
    run(s)
    assert r.finish_reason == "length" and r.num_tokens == 21  # the 21st token needs a 6th block
    assert r.blocks == [] and s.num_preemptions == 0
    assert s.cache.usage().num_referenced_blocks == 0


def test_a_request_behind_pins_gets_no_block_ever_finishes_with_error():
    s = pinned_pool(4)  # 4 blocks left
    r = request("r", range(100, 120), max_tokens=2)  # a 20-token prompt needs 5 blocks at once
    s.add_request(r)
    out = s.schedule()
    assert out.finished == [r] and not out.scheduled and not s.waiting
    assert r.finish_reason == "error" and "pinned prefixes hold 4 of the pool's 8" in r.error
    ok = request("ok", range(300, 306), max_tokens=2)  # the pool still serves what fits
    s.add_request(ok)
    run(s)
    assert ok.finish_reason == "length" and s.cache.usage().num_referenced_blocks == 0


def test_the_newest_request_still_yields_to_older_ones():
    s = pinned_pool(3)  # 5 blocks left
    old, new = request("old", range(100, 107), max_tokens=9), request("new", range(200, 207), max_tokens=9)
    s.add_request(old)
    s.add_request(new)
    run(s)
    assert old.finish_reason == new.finish_reason == "length"
    assert old.num_output_tokens == new.num_output_tokens == 9 and s.num_preemptions > 0
