"""Which answers' latencies steer the latency target's safety margin."""

from __future__ import annotations

from worker.pipeline.answers import Answer
from worker.pipeline.reply import served_online_ms


def answer(ok: bool, background: bool = False) -> Answer:
    return Answer("1-0", "reply:x", "application/msgpack", {"ok": ok}, 1, background=background)


def test_only_served_online_answers_are_held_to_the_target() -> None:
    answered = [answer(True), answer(False), answer(True, background=True), answer(True)]
    assert served_online_ms(answered, [0.01, 0.02, 5.0, 0.03]) == [10.0, 30.0]
