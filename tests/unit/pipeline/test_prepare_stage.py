"""The prepare stage (worker/pipeline/prepare_stage.py): reads are prepared in order, off the
caller's thread, at most `depth` behind it, and a failure reaches the caller."""

from __future__ import annotations

import threading

import pytest

from worker.pipeline.prepare_stage import PrepareStage


def test_work_runs_in_order_on_the_stage_thread() -> None:
    stage = PrepareStage()
    done: list[tuple[int, str]] = []
    for n in range(20):
        stage.submit(lambda n: done.append((n, threading.current_thread().name)), n)
    stage.drain()
    assert [n for n, _ in done] == list(range(20))
    assert {name for _, name in done} == {"redbatch-prepare_0"}


def test_the_caller_waits_once_depth_reads_are_unfinished() -> None:
    stage = PrepareStage(depth=2)
    gate = threading.Event()
    stage.submit(gate.wait, 10)
    stage.submit(lambda: None)  # two unfinished: the depth
    third = threading.Thread(target=stage.submit, args=(lambda: None,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # held back until the first is done
    gate.set()
    third.join(10)
    assert not third.is_alive()
    stage.drain()


def test_a_failure_is_raised_to_the_caller_at_its_next_hand_over_or_drain() -> None:
    stage = PrepareStage(depth=1)

    def fail() -> None:
        raise RuntimeError("bug in preparing")

    stage.submit(fail)
    with pytest.raises(RuntimeError, match="bug in preparing"):
        stage.submit(lambda: None)
    stage.drain()  # the failure was raised once; the thread stops
    failing = PrepareStage()
    failing.submit(fail)
    with pytest.raises(RuntimeError, match="bug in preparing"):
        failing.drain()


def test_unthreaded_it_runs_at_once_on_the_callers_thread() -> None:
    stage = PrepareStage(threaded=False)
    names: list[str] = []
    stage.submit(lambda: names.append(threading.current_thread().name))
    assert names == [threading.current_thread().name]
    stage.drain()
