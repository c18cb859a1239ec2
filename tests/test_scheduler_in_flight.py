"""A waiting request whose prefix a running request is computing lets others pass, then hits (in_flight.py)."""

from test_scheduler import BS, make, request, run, step

from prefixserve.cache import CacheScope
from prefixserve.engine.in_flight import IN_FLIGHT_MIN_TOKENS
from prefixserve.engine.request import Request, RequestStatus
from prefixserve.engine.sampling_params import SamplingParams

SHARED = list(range(1000, 1000 + 10 * BS + 2))  # 10 full blocks and 2 tokens: well over IN_FLIGHT_MIN_TOKENS
assert len(SHARED) >= IN_FLIGHT_MIN_TOKENS + BS


def test_requests_arriving_together_on_one_prompt_compute_it_once():
    s = make(num_blocks=64, budget=256)
    requests = [request(f"r{i}", SHARED + [i, i + 1, i + 2]) for i in range(4)]
    for r in requests:
        s.add_request(r)
    plan, _ = step(s)
    assert plan == [("r0", len(SHARED) + 3)]  # the others wait for its blocks instead of computing them too
    plan, _ = step(s)
    own = len(SHARED) + 3 - 10 * BS  # the partial block and their own tokens
    assert plan == [("r0", 1)] + [(f"r{i}", own) for i in range(1, 4)]
    assert [r.num_cached_tokens for r in requests] == [0, 10 * BS, 10 * BS, 10 * BS]
    run(s)
    assert all(r.finish_reason == "length" for r in requests)


def test_a_prompt_longer_than_the_budget_is_waited_for_while_enough_of_it_is_left():
    s = make(num_blocks=64, budget=16)
    long_prompt = list(range(3000, 3000 + 20 * BS))
    first, second = request("first", long_prompt + [1]), request("second", long_prompt + [2])
    s.add_request(first)
    s.add_request(second)
    while not second.was_admitted:
        left = len(long_prompt) - first.num_computed_tokens  # shared tokens nobody has computed yet
        plan, _ = step(s)
        if left >= IN_FLIGHT_MIN_TOKENS:
            assert "second" not in dict(plan), (left, plan)
    # it joined with less than IN_FLIGHT_MIN_TOKENS of the prompt left to compute twice
    assert len(long_prompt) - IN_FLIGHT_MIN_TOKENS < second.num_cached_tokens <= len(long_prompt)
    run(s)


def test_an_unrelated_request_is_not_held_back_and_passes_the_waiting_one():
    s = make(num_blocks=64, budget=256)
    s.add_request(request("a", SHARED + [1]))
    s.add_request(request("b", SHARED + [2]))
    s.add_request(request("other", list(range(5000, 5020))))
    plan, _ = step(s)
    assert plan == [("a", len(SHARED) + 1), ("other", 20)]


def test_a_short_shared_run_is_computed_twice_rather_than_waited_for():
    s = make(num_blocks=64, budget=256)
    short = list(range(2000, 2000 + BS))  # one shared block: less than IN_FLIGHT_MIN_TOKENS
    s.add_request(request("a", short + [1] * 8))
    s.add_request(request("b", short + [2] * 8))
    plan, _ = step(s)
    assert [name for name, _ in plan] == ["a", "b"]


def test_nobody_waits_for_a_request_whose_blocks_are_never_cached():
    s = make(num_blocks=64, budget=256)
    private = request("private", SHARED + [1])
    private.cache_retention = "none"
    s.add_request(private)
    s.add_request(request("b", SHARED + [2]))
    plan, _ = step(s)
    assert [name for name, _ in plan] == ["private", "b"]


def test_another_tenants_identical_prompt_is_not_waited_for():
    s = make(num_blocks=64, budget=256)
    other_scope = CacheScope("model", "tokenizer", cache_salt="tenant-b").digest
    theirs = Request(
        "theirs", SHARED + [1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), other_scope
    )
    s.add_request(request("ours", SHARED + [1]))
    s.add_request(theirs)
    plan, _ = step(s)
    assert [name for name, _ in plan] == ["ours", "theirs"]
    run(s)
    assert theirs.num_cached_tokens == 0


def test_lpm_admits_the_longest_cached_match_among_those_that_do_not_wait():
    s = make(num_blocks=64, budget=256, policy="lpm")
    s.add_request(request("a", SHARED + [1]))
    s.add_request(request("b", SHARED + [2]))
    s.add_request(request("c", list(range(7000, 7010))))
    plan, _ = step(s)
    assert sorted(name for name, _ in plan) == ["a", "c"]
    plan, _ = step(s)
    assert ("b", len(SHARED) + 1 - 10 * BS) in plan


def test_requests_fetching_from_a_tier_are_passed_however_many_lead_the_queue():
    s = make(num_blocks=256, budget=64, max_num_seqs=128)
    fetching = [request(f"f{i}", range(10 * i, 10 * i + 5)) for i in range(70)]  # more than LPM_WINDOW
    for r in fetching:
        r.status = RequestStatus.WAITING_FOR_KV
        s.add_request(r)
    s.add_request(request("ready", range(9000, 9005)))
    plan, _ = step(s)
    assert plan == [("ready", 5)]
