"""Stop strings: the Aho-Corasick matcher against a brute-force reference in random chunkings,
and through the engine (cut text, stop_reason, nothing past the stop ever streamed)."""

import pytest
from conftest import make_llm
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import SamplingParams
from prefixserve.engine.sampling_params import MAX_STOP_STRINGS
from prefixserve.engine.stop_strings import StopMatch, StopMatcher


def reference_match(text: str, stops: list[str]):
    """The first stop string to complete; of those completing together, the earliest start."""
    for end in range(1, len(text) + 1):
        completing = [stop for stop in stops if text[:end].endswith(stop)]
        if completing:
            stop = max(completing, key=len)
            return StopMatch(end - len(stop), stop)
    return None


def feed_in_chunks(matcher: StopMatcher, text: str, cuts: list[int]):
    bounds = [0] + sorted(set(cut % (len(text) + 1) for cut in cuts)) + [len(text)]
    for start, end in zip(bounds, bounds[1:]):
        match = matcher.feed(text[start:end])
        if match is not None:
            return match
    return None


ALPHABET = "abc "  # small, so stop strings overlap, nest and repeat


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
    text=st.text(ALPHABET, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_matcher_agrees_with_brute_force_in_any_chunking(stops, text, cuts):
    assert feed_in_chunks(StopMatcher(stops), text, cuts) == reference_match(text, stops)


def test_matcher_examples():
    matcher = StopMatcher(["lo_w", "o_wor", "d"])
    assert matcher.feed("hel") is None and matcher.feed("lo_") is None
    assert matcher.feed("world") == StopMatch(3, "lo_w")
    # Same end: the longer (earlier-starting) one wins, whichever was listed first.
    assert StopMatcher(["c", "abc"]).feed("xxabc") == StopMatch(2, "abc")
    assert StopMatcher(["bcd", "abcde"]).feed("abcdef") == StopMatch(1, "bcd")  # first to complete
    assert StopMatcher(["ab"]).max_stop_len == 2 and StopMatcher([]).feed("anything") is None


class CountingList(list):
    num_reads = 0

    def __getitem__(self, index):
        CountingList.num_reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("num_stops", [1, 1000])
def test_matching_cost_does_not_grow_with_the_number_of_stop_strings(num_stops):
    # Count failure-link hops of the real feed() instead of timing it.
    stops = [f"stop-{i:04d}!" for i in range(num_stops)]
    matcher = StopMatcher(stops)
    matcher._fail = CountingList(matcher._fail)
    CountingList.num_reads = 0
    text = "stop-00 stop-0000 stop-99 " * 200
    assert matcher.feed(text) is None
    assert CountingList.num_reads <= len(text)  # amortised O(1) per character, whatever num_stops
    assert matcher.feed("stop-0000!") == StopMatch(len(text), "stop-0000!")


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_stop_strings_cut_the_text_and_are_never_streamed(llm):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    greedy = llm.generate(["Hello"], params, use_tqdm=False)[0]
    stop_text = greedy.text[len(greedy.text) // 2 : len(greedy.text) // 2 + 4]
    stops = [f"never-{i}" for i in range(MAX_STOP_STRINGS - 1)] + [stop_text]
    engine = llm.engine
    request = engine.add_request("Hello", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stops))
    streamed, outputs = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text
            outputs.append(out)
    final = outputs[-1]
    assert final.request_id == request.request_id and final.finish_reason == "stop"
    assert final.stop_reason == stop_text
    assert final.text == streamed == greedy.text[: greedy.text.index(stop_text)]
    # Every token was reported once, in order; the one completing the stop stays in token_ids (as vLLM).
    assert [t for out in outputs for t in out.delta_token_ids] == final.token_ids
