"""Stop-string matching over streamed text in time independent of how many stop strings there are.

An Aho-Corasick automaton (Aho & Corasick 1975, "Efficient string matching: an aid to
bibliographic search") over the request's stop strings is fed the generated text one character at a
time. Its state after the last character is the longest suffix of the text that is a prefix of some
stop string, which is exactly the tail the engine must hold back from streaming; a state that ends a
stop string is a match. Feeding a character costs O(1) amortised (failure links), and building the
automaton costs O(total length of the stop strings) once per request, so per-token work no longer
grows with the stop list (the naive ``text.find(s)`` for every ``s`` per token did).

Plain Python, no torch; one automaton per request, one :class:`StopState` per sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class StopMatcher:
    """The automaton for a list of non-empty stop strings.

    Attributes:
        max_len: length of the longest stop string (characters).
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._out: list[str] = [""]  # the longest stop string ending at this state ("" : none)
        for s in self.stops:
            self._insert(s)
        self._link()

    def _insert(self, s: str) -> None:
        node = 0
        for ch in s:
            nxt = self._goto[node].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[node][ch] = nxt
                self._goto.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._out.append("")
            node = nxt
        self._out[node] = s

    def _link(self) -> None:
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                target = self._goto[f].get(ch, 0)
                self._fail[child] = target if target != child else 0
                # a stop string ending at the failure state also ends here; keep the longest
                if not self._out[child]:
                    self._out[child] = self._out[self._fail[child]]
                queue.append(child)

    def step(self, state: int, ch: str) -> int:
        """The state after reading ``ch`` in ``state``."""
        while state and ch not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(ch, 0)

    def depth(self, state: int) -> int:
        """Characters of the longest text suffix that is a prefix of a stop string."""
        return self._depth[state]

    def match(self, state: int) -> str:
        """The longest stop string ending at the text's end in ``state`` ("": none)."""
        return self._out[state]


@dataclass
class StopState:
    """One sequence's position in a :class:`StopMatcher` over its text."""

    matcher: StopMatcher
    state: int = 0
    fed: int = 0  # characters of the text already fed

    def feed(self, text: str) -> tuple[int, str] | None:
        """Feed ``text[self.fed:]``; return ``(start index, stop string)`` of the earliest-starting
        stop string that ends inside the newly fed characters, or None.

        Among the matches that end in the new characters the one that starts first wins (what
        ``min((text.find(s), s) for s in stops)`` over the new text gives). Raises nothing.
        """
        best = None
        m = self.matcher
        for i in range(self.fed, len(text)):
            self.state = m.step(self.state, text[i])
            s = m.match(self.state)
            if s and (best is None or i - len(s) + 1 < best[0]):
                best = (i - len(s) + 1, s)
        self.fed = len(text)
        return best

    def held_back(self) -> int:
        """Characters at the end of the fed text that may still grow into a stop string."""
        return self.matcher.depth(self.state)
