"""Stop strings matched as text streams in, at O(1) amortised cost per character whatever
their number: an Aho-Corasick automaton over the stop strings, fed only the new characters of
each step, its state kept between steps.

Semantics (vLLM's): the first stop string to complete in the text ends the request; of several
completing at the same character, the one that starts earliest (the longest) wins; the text is
cut where it starts.

    text:  ... h e l l o _ w o r l d
    stops: "lo_w", "o_wor", "d"           fed one step at a time, in any chunks
                   ^ "lo_w" completes first (at 'w'); the text is cut before its 'l'
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Optional, Sequence


class StopMatch(NamedTuple):
    start: int  # offset in the whole text fed so far where the stop string begins
    stop: str


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(dict.fromkeys(stops))
        self.max_stop_len = max(map(len, self.stops), default=0)  # the streaming hold-back bound
        self._goto: list[dict[str, int]] = [{}]  # trie edges
        self._fail: list[int] = [0]  # longest proper suffix that is also a trie node
        self._stop_at: list[Optional[str]] = [None]  # longest stop string ending at this node
        for stop in self.stops:
            self._add(stop)
        self._link()
        self._state = 0
        self._num_fed = 0

    def _add(self, stop: str) -> None:
        node = 0
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = len(self._goto)
                self._goto[node][char] = child
                self._goto.append({})
                self._fail.append(0)
                self._stop_at.append(None)
            node = child
        self._stop_at[node] = stop  # a node's own string is longer than any suffix match

    def _link(self) -> None:
        """Failure links in breadth-first order, so a node's suffix is linked before the node."""
        goto, fail, stop_at = self._goto, self._fail, self._stop_at
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for char, child in goto[node].items():
                suffix = fail[node]
                while suffix and char not in goto[suffix]:
                    suffix = fail[suffix]
                fail[child] = goto[suffix].get(char, 0)
                if stop_at[child] is None:
                    stop_at[child] = stop_at[fail[child]]
                queue.append(child)

    def feed(self, text: str) -> Optional[StopMatch]:
        """Advance over `text` (the characters new since the last call); the first match, if any."""
        goto, fail, stop_at = self._goto, self._fail, self._stop_at
        state = self._state
        for offset, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            stop = stop_at[state]
            if stop is not None:
                end = self._num_fed + offset + 1
                self._state, self._num_fed = state, end
                return StopMatch(end - len(stop), stop)
        self._state = state
        self._num_fed += len(text)
        return None
