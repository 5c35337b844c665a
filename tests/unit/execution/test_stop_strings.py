"""The stop-string automata against a plain search of the whole text, on random texts fed in
random pieces (small alphabets, so that partial matches and overlaps are frequent)."""

from __future__ import annotations

import random

import pytest

from worker.execution.stop_strings import StopStrings, prefix_function


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """The longest tail of the text that starts a stop string (a whole one excluded)."""
    return max((size for stop in stops for size in range(1, min(len(stop) - 1, len(text)) + 1)
                if text.endswith(stop[:size])), default=0)


def test_prefix_function() -> None:
    assert prefix_function("aabaaab") == [0, 1, 0, 1, 2, 2, 3]
    assert prefix_function("abcd") == [0, 0, 0, 0]
    assert prefix_function("") == []


@pytest.mark.parametrize("seed", range(300))
def test_fed_in_pieces_it_finds_what_a_search_of_the_whole_text_finds(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = tuple("".join(rng.choices(alphabet, k=rng.randint(1, 6)))
                  for _ in range(rng.randint(0, 4)))
    matcher, text, first = StopStrings(stops), "", None
    while len(text) < 40 and first is None:
        piece = "".join(rng.choices(alphabet, k=rng.randint(1, 5)))
        found = matcher.feed(piece)
        text += piece
        first = found
        if found is None:
            assert first_stop(text, stops) is None
            assert matcher.held_back() == held_back(text, stops)
    assert first == first_stop(text, stops)


def test_a_match_that_starts_earlier_wins_over_one_that_ends_earlier() -> None:
    matcher = StopStrings(("abcd", "bc"))
    assert matcher.feed("xabcd") == 1  # "abcd" from 1 ends after "bc" from 2
    assert StopStrings(("abcd", "bc")).feed("xabc") == 2


def test_reset_forgets_the_text() -> None:
    matcher = StopStrings(("ab",))
    assert matcher.feed("a") is None and matcher.held_back() == 1
    matcher.reset()
    assert matcher.held_back() == 0
    assert matcher.feed("ab") == 0


class CountedStr(str):
    """A stop string that counts how often the automaton reads one of its characters."""

    reads = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        CountedStr.reads += 1
        return str.__getitem__(self, key)


def test_a_step_costs_its_new_characters_not_the_text_or_the_stop_strings() -> None:
    """The case that made a row's step cost milliseconds: four stop strings of 4,096
    characters whose first character never matches a text of thousands of characters.
    Counted in the characters of the stop strings the automaton reads, not timed."""
    matcher = StopStrings([CountedStr("0" + "x" * 4095) for _ in range(4)])
    matcher.feed("x" * 4000)
    CountedStr.reads = 0
    for _ in range(100):  # each feed is one token's text; held_back is read every step
        assert matcher.feed("xxxx") is None
        assert matcher.held_back() == 0
    assert CountedStr.reads <= 3 * 4 * 400  # a few reads a character a string
    assert matcher.feed("0xx") is None and matcher.held_back() == 3
