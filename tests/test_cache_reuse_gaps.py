"""ReuseGapTracker: the release -> next use gap of prefixes, with a fake clock and exact expectations."""

import pytest

from prefixserve.cache.reuse_gaps import GAP_BUCKETS, ReuseGapTracker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


@pytest.fixture
def clock():
    return Clock()


def test_the_next_turn_of_a_conversation_closes_the_gap_since_the_last_release(clock):
    tracker = ReuseGapTracker(block_size=16, clock=clock)
    tracker.released("acme", keys("a", "b", "c"), num_prompt_blocks=2)  # turn 1: prompt a b, reply in c
    clock.now += 42.0
    assert tracker.admitted("acme", keys("a", "b", "c", "d")) == 42.0  # turn 2 extends the whole turn
    snapshot = tracker.snapshot()
    overall = snapshot["overall"]
    assert overall["count"] == 1 and overall["sum"] == 42.0 and overall["num_releases"] == 1
    assert overall["counts"][GAP_BUCKETS.index(60)] == 1  # 30 < 42 <= 60
    assert snapshot["by_tenant"]["acme"]["count"] == 1
    assert snapshot["mean_reused_prefix_tokens"] == 3 * 16


def test_a_re_rendered_reply_still_matches_through_the_prompt_key(clock):
    tracker = ReuseGapTracker(block_size=16, clock=clock)
    tracker.released("t", keys("a", "b", "c"), num_prompt_blocks=2)
    clock.now += 5.0
    assert tracker.admitted("t", keys("a", "b", "x")) == 5.0  # shares the prompt, not the reply block
    assert tracker.snapshot()["mean_reused_prefix_tokens"] == 2 * 16
    clock.now += 5.0
    assert tracker.admitted("t", keys("a", "b", "c")) is None  # the release was used up by the first return
    assert tracker.overall.count == 1


def test_one_release_is_followed_by_one_next_turn_and_unrelated_prompts_close_nothing(clock):
    tracker = ReuseGapTracker(block_size=16, clock=clock)
    tracker.released(None, keys("p", "q"), num_prompt_blocks=2)
    assert tracker.admitted(None, keys("z")) is None
    clock.now += 1.0
    assert tracker.admitted(None, keys("p", "q")) == 1.0
    assert tracker.admitted(None, keys("p", "q")) is None
    assert set(tracker.snapshot()["by_tenant"]) == {"default"}
    assert tracker.overall.num_releases == 1


def test_gaps_fall_in_their_buckets_and_the_last_bucket_holds_what_is_longer(clock):
    tracker = ReuseGapTracker(block_size=4, clock=clock)
    for index, gap in enumerate((0.5, 0.7, 86400.0, 90000.0)):
        key = keys(f"k{index}")
        tracker.released("t", key, num_prompt_blocks=1)
        clock.now += gap
        tracker.admitted("t", key)
    counts = tracker.snapshot()["overall"]["counts"]
    assert len(counts) == len(GAP_BUCKETS) + 1
    assert counts[0] == 1  # 0.5 is within the first bound
    assert counts[1] == 1  # 0.7 <= 1
    assert counts[GAP_BUCKETS.index(86400)] == 1
    assert counts[-1] == 1


def test_memory_is_bounded_oldest_releases_forgotten_first(clock):
    tracker = ReuseGapTracker(block_size=16, clock=clock, max_prefixes=2)
    tracker.released("t", keys("a"), 1)
    tracker.released("t", keys("b"), 1)
    tracker.released("t", keys("c"), 1)
    assert tracker.num_remembered == 2
    assert tracker.admitted("t", keys("a")) is None
    assert tracker.admitted("t", keys("c")) == 0.0
    assert tracker.overall.num_releases == 3


def test_the_snapshot_is_memoised_until_something_changes(clock):
    tracker = ReuseGapTracker(block_size=16, clock=clock)
    first = tracker.snapshot()
    assert tracker.snapshot() is first
    tracker.released("t", keys("a"), 1)
    assert tracker.snapshot() is not first


def test_bad_bounds_name_the_fix():
    with pytest.raises(ValueError, match="max_prefixes"):
        ReuseGapTracker(block_size=16, max_prefixes=0)
