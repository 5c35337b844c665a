"""A request's stop strings, matched in its text as the text grows: where the first one
starts, and how much of the text's end could still be the start of one.

Why: searched anew each step (a `find` per string, then a slice and `endswith` per candidate
length to find the tail that must be held back), a step cost a row O(text x stop length).
Four stop strings of a few thousand characters, which fit in one payload, made that 2.6 ms
a row a step, paid by every request in the batch. Here each string has a Knuth-Morris-Pratt
automaton (hand-written: the standard library has none that can be fed piece by piece), fed
only the characters a step added: amortised O(1) a character, and the automaton's state is
the length of the held-back tail itself.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_function(pattern: str) -> list[int]:
    """For each i, the length of the longest proper prefix of pattern[:i + 1] that is also
    its suffix (KMP's failure function)."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._fail = [prefix_function(stop) for stop in self.stops]
        self.reset()

    def reset(self) -> None:
        """Forget every character fed: the text starts again from nothing."""
        self._matched = [0] * len(self.stops)  # each string's prefix that ends the text
        self._fed = 0  # characters fed so far (the next one's index in the text)

    def feed(self, text: str) -> int | None:
        """Add `text` to the end of the text; returns where the first stop string that it
        completes starts (an index in the whole text), or None."""
        first: int | None = None
        for n, stop in enumerate(self.stops):
            start = self._advance(n, stop, text)
            if start is not None and (first is None or start < first):
                first = start
        self._fed += len(text)
        return first

    def held_back(self) -> int:
        """The length of the longest tail of the text that is the start of a stop string
        (a whole one excluded): text that may yet turn out to be a stop string's."""
        return max((min(matched, len(stop) - 1)
                    for matched, stop in zip(self._matched, self.stops, strict=True)),
                   default=0)

    def _advance(self, n: int, stop: str, text: str) -> int | None:
        """Feed `text` to string n's automaton; where its first match in it starts."""
        matched, fail = self._matched[n], self._fail[n]
        found = None
        for i, char in enumerate(text):
            while matched and (matched == len(stop) or stop[matched] != char):
                matched = fail[matched - 1]
            if stop[matched] == char:
                matched += 1
            if matched == len(stop) and found is None:
                found = self._fed + i + 1 - len(stop)
        self._matched[n] = matched
        return found
