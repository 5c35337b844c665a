"""Settling a window of replies (pure): answers once, lines of several parts, retries."""

from __future__ import annotations

import json
from typing import Any

from producer.batches import keys, lines
from producer.batches.pacing import Moved, admission_order, backlog_room, movement
from producer.batches.settling import answered_bit, settle

BATCH = "batch_" + "a" * 24


def raw(custom_id: str, inputs: Any = "hi") -> bytes:
    return json.dumps({"custom_id": custom_id, "url": "/v1/embeddings",
                       "body": {"model": "minilm", "input": inputs}}).encode()


def ok(line: int, attempt: int = 1, part: int = 0) -> dict[str, Any]:
    return {"id": keys.request_id(BATCH, line, attempt, part), "ok": True,
            "result": {"embedding": [0.5, 0.5]}, "meta": {}}


def failed(line: int, code: str, **details: Any) -> dict[str, Any]:
    return {"id": keys.request_id(BATCH, line, 1, 0), "ok": False,
            "error": {"code": code, "message": "m", **details}}


def run(envelopes: list[dict[str, Any] | None], raws: dict[int, bytes], done: bytes = b"",
        stored: dict[str, bytes | None] | None = None) -> Any:
    return settle(BATCH, envelopes, raws, done, 16, 0, 1000, 500, stored)


def test_one_part_lines_are_answered_and_answered_lines_skipped() -> None:
    result = run([ok(0), ok(1), None, {"id": "someone-else", "ok": True}],
                 {0: raw("a"), 1: raw("b")}, done=bytes([0b0100_0000]))
    assert [(line, good) for line, good, _ in result.answers] == [(0, True)]
    out = json.loads(result.answers[0][2])
    assert out["custom_id"] == "a" and out["response"]["status_code"] == 200
    assert out["response"]["body"]["data"][0]["embedding"] == [0.5, 0.5]


def test_a_line_of_several_parts_waits_for_all_of_one_attempt() -> None:
    raws = {3: raw("many", ["x", "y", "z"])}
    first = run([ok(3, part=0), ok(3, part=2)], raws)
    assert first.needs_parts == [keys.request_id(BATCH, 3, 1, 1)] and not first.answers
    waiting = run([ok(3, part=0), ok(3, part=2)], raws, stored={first.needs_parts[0]: None})
    assert [rid for rid, _ in waiting.kept] == [keys.request_id(BATCH, 3, 1, p) for p in (0, 2)]
    stored = dict(waiting.kept)
    complete = run([ok(3, part=1)], raws, stored={**stored})
    assert [good for _, good, _ in complete.answers] == [True]
    assert sorted(complete.dropped) == [keys.request_id(BATCH, 3, 1, p) for p in range(3)]
    body = json.loads(complete.answers[0][2])["response"]["body"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]


def test_shed_lines_retry_after_the_workers_time_and_late_ones_expire() -> None:
    result = run([failed(0, "overloaded", retry_after_ms=250), failed(1, "overloaded"),
                  failed(2, "deadline_exceeded"), failed(4, "model_error")],
                 {n: raw(f"c{n}") for n in range(5)})
    assert result.retries == [(0, 1, 1250), (1, 1, 1500)]
    expired = json.loads(result.answers[0][2])
    assert result.answers[0][:2] == (2, False) and expired["response"] is None
    assert expired["error"]["code"] == lines.EXPIRED[0]
    assert result.answers[1][:2] == (4, False)
    assert json.loads(result.answers[1][2])["response"]["status_code"] == 500


def test_bits_are_numbered_as_redis_setbit_numbers_them() -> None:
    assert answered_bit(bytes([0b1000_0001]), 0) and answered_bit(bytes([0b1000_0001]), 7)
    assert not answered_bit(bytes([0b1000_0001]), 1) and not answered_bit(b"", 3)


def test_the_window_halves_on_shedding_and_grows_with_answers() -> None:
    from producer.batches.pacing import Pacing

    pacing = Pacing(64)
    assert [pacing.settled(0, 5), pacing.settled(3, 1), pacing.settled(4, 0)] == [32, 16, 20]
    for _ in range(10):
        pacing.settled(0, 1)
    assert pacing.window == 1 and pacing.settled(100, 0) == 64


def test_the_backlog_room_shrinks_to_the_busy_backlog_while_online_requests_wait() -> None:
    assert backlog_room(64, 2, 0, 0) == 64  # nothing queued: the whole backlog
    assert backlog_room(64, 2, 10, 10) == 54  # only the batch's own lines queued
    assert backlog_room(64, 2, 5, 1) == 1  # online requests wait: at most 2 of the batch's
    assert backlog_room(64, 2, 5, 3) == -1  # already over: admit none
    assert backlog_room(64, 2, 70, 0) == -6  # the backlog is full anyway


def test_a_step_that_waits_on_lines_in_flight_looks_again_soon() -> None:
    assert movement(True, 0) is Moved.MOVED  # settled or admitted: the next replies are due
    assert movement(False, 3) is Moved.WAITING  # lines queued or computing: replies soon
    assert movement(False, 0) is Moved.IDLE  # nothing to wait on: the idle poll


def test_lines_are_admitted_shortest_first_ties_in_file_order() -> None:
    assert admission_order([30, 5, 30, 1]) == [3, 1, 0, 2]
    assert admission_order([]) == []
