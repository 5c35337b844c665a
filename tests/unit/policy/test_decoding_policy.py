"""The iteration-level scheduler (worker/policy/decoding.py), without a model."""

from __future__ import annotations

import random

import pytest

from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState


def scheduler(**limits: int) -> DecodingScheduler:
    return DecodingScheduler(SchedulerLimits(**limits))


def drive(sched: DecodingScheduler, steps: int = 10_000) -> dict[str, int]:
    """Run to the end; the step at which each sequence finished."""
    finished: dict[str, int] = {}
    for step in range(steps):
        if not len(sched):
            return finished
        sched.schedule()
        finished.update((s.id, step) for s in sched.update())
    raise AssertionError("did not finish")


def test_first_step_prefills_then_decodes_one_token_each() -> None:
    sched = scheduler(max_step_tokens=100)
    sched.add(SeqState("a", prompt_len=5, max_new_tokens=3))
    sched.add(SeqState("b", prompt_len=7, max_new_tokens=3))
    plan = sched.schedule()
    assert [(w.id, w.start, w.end, w.emits) for w in plan.prefill] == [
        ("a", 0, 5, True), ("b", 0, 7, True)]
    assert plan.admitted == ["a", "b"] and not plan.decode
    sched.update()
    plan = sched.schedule()
    assert [(w.id, w.start, w.end) for w in plan.decode] == [("a", 5, 6), ("b", 7, 8)]
    assert all(w.emits for w in plan.decode)


def test_a_long_prompt_is_prefilled_in_chunks_within_the_step_budget() -> None:
    sched = scheduler(max_step_tokens=8)
    sched.add(SeqState("short", prompt_len=3, max_new_tokens=10))
    sched.add(SeqState("long", prompt_len=20, max_new_tokens=2))
    chunks = []
    for step in range(5):
        plan = sched.schedule()
        assert plan.tokens <= 8
        if step:
            assert plan.decode[0].id == "short"  # decoding goes on meanwhile
        chunks += [(w.start, w.end, w.emits) for w in plan.work if w.id == "long"]
        sched.update()
    # the last token of a chunked prompt is fed like a decode step
    assert chunks == [(0, 5, False), (5, 12, False), (12, 19, False), (19, 20, True),
                      (20, 21, True)]


def test_max_seqs_caps_the_running_set_and_the_rest_wait() -> None:
    sched = scheduler(max_seqs=2)
    for i in range(4):
        sched.add(SeqState(f"s{i}", prompt_len=2, max_new_tokens=2))
    plan = sched.schedule()
    assert plan.admitted == ["s0", "s1"]
    sched.update()
    assert [s.id for s in sched.running] == ["s0", "s1"]
    sched.schedule()
    assert {s.id for s in sched.update()} == {"s0", "s1"}  # finished ones leave at once
    assert sched.schedule().admitted == ["s2", "s3"]


def test_finished_ones_leave_at_once_and_free_their_cache() -> None:
    sched = scheduler()
    sched.add(SeqState("a", prompt_len=4, max_new_tokens=50))
    sched.add(SeqState("b", prompt_len=4, max_new_tokens=50))
    sched.schedule()
    sched.update()
    sched.schedule()
    gone = sched.update(finished=["a"])  # e.g. a stop string
    assert [s.id for s in gone] == ["a"]
    assert [s.id for s in sched.running] == ["b"] and sched.used_tokens == 5


def test_higher_priority_first_then_oldest() -> None:
    sched = scheduler(max_seqs=1)
    sched.add(SeqState("old-low", 2, 1, priority=0))
    sched.add(SeqState("new-high", 2, 1, priority=5))
    sched.add(SeqState("newer-high", 2, 1, priority=5))
    order = []
    while len(sched):
        order += sched.schedule().admitted
        sched.update()
    assert order == ["new-high", "newer-high", "old-low"]


def test_memory_pressure_preempts_the_newest_by_recompute_and_loses_nothing() -> None:
    # 20 tokens of KV: two sequences of 6 + 10 new tokens cannot both stay resident.
    sched = scheduler(bytes_per_token=4, kv_budget_bytes=80)
    sched.add(SeqState("old", prompt_len=6, max_new_tokens=10))
    sched.add(SeqState("new", prompt_len=6, max_new_tokens=10))
    preempted, recomputed = [], []
    finished: dict[str, int] = {}
    for step in range(100):
        if not len(sched):
            break
        plan = sched.schedule()
        assert sched.used_tokens + plan.tokens <= 20
        preempted += plan.preempted
        recomputed += [(w.id, w.start, w.end) for w in plan.prefill
                       if w.id == "new" and w.start == 0 and w.end > 6]
        finished.update((s.id, step) for s in sched.update())
    assert preempted and set(preempted) == {"new"}  # the most recently admitted
    assert recomputed, "re-prefilled with its prompt and the tokens generated so far"
    assert set(finished) == {"old", "new"}
    assert finished["old"] < finished["new"]


def test_a_preempted_sequence_keeps_its_generated_count() -> None:
    sched = scheduler(bytes_per_token=1, kv_budget_bytes=12)
    sched.add(SeqState("a", prompt_len=4, max_new_tokens=9))
    sched.add(SeqState("b", prompt_len=4, max_new_tokens=3))
    generated = {}
    while len(sched):
        plan = sched.schedule()
        for seq in sched.running + sched.waiting:
            generated[seq.id] = seq.generated
        for seq in sched.update():
            assert seq.generated == seq.max_new_tokens  # nothing lost, nothing extra
        del plan
    assert generated["a"] <= 9 and generated["b"] <= 3


def test_a_sequence_that_can_never_fit_is_refused_at_add() -> None:
    sched = scheduler(bytes_per_token=2, kv_budget_bytes=20)  # 10 tokens
    assert sched.fits(5, 6) and not sched.fits(5, 7)
    with pytest.raises(ValueError, match="KV budget"):
        sched.add(SeqState("big", prompt_len=5, max_new_tokens=7))


def test_no_starvation_a_low_priority_request_is_admitted_within_the_bound() -> None:
    """High-priority requests arrive every step, enough to keep every slot busy; the
    low-priority one is still admitted within max_wait_steps + the longest running life."""
    max_wait, life = 8, 6
    sched = scheduler(max_seqs=4, max_wait_steps=max_wait)
    sched.add(SeqState("high-0", 3, life, priority=9))
    sched.add(SeqState("low", 3, life, priority=0))
    admitted_at = None
    for step in range(200):
        sched.add(SeqState(f"high-{step + 1}", 3, life, priority=9))
        plan = sched.schedule()
        if "low" in plan.admitted:
            admitted_at = step
            break
        sched.update()
    assert admitted_at is not None and admitted_at <= max_wait + life + 1


def test_random_load_every_request_finishes_within_the_limits() -> None:
    rng = random.Random(7)
    limits = SchedulerLimits(max_step_tokens=32, max_seqs=5, bytes_per_token=3,
                             kv_budget_bytes=3 * 120, max_wait_steps=10)
    sched = DecodingScheduler(limits)
    wanted, finished, added = {}, {}, 0
    for _ in range(3000):
        if added < 60 and rng.random() < 0.4:
            seq = SeqState(f"r{added}", rng.randint(1, 60), rng.randint(1, 40),
                           priority=rng.choice([0, 0, 1, 5]))
            wanted[seq.id] = seq.max_new_tokens
            sched.add(seq)
            added += 1
        plan = sched.schedule()
        assert plan.tokens <= 32 and len(sched.running) <= 5
        assert sched.used_tokens + plan.tokens <= 120
        assert len({w.id for w in plan.work}) == len(plan.work)
        for seq in sched.update():
            finished[seq.id] = seq.generated
        if added == 60 and not len(sched):
            break
    assert finished == wanted


def test_prefill_first_gives_an_arrival_a_step_of_its_own_but_never_two_in_a_row() -> None:
    sched = DecodingScheduler(SchedulerLimits(max_step_tokens=100, prefill_first=True))
    sched.add(SeqState("a", prompt_len=5, max_new_tokens=20))
    sched.schedule()
    sched.update()
    sched.add(SeqState("b", prompt_len=6, max_new_tokens=20))
    plan = sched.schedule()  # b alone: a's decode waits one step
    assert [w.id for w in plan.prefill] == ["b"] and not plan.decode
    sched.update()
    sched.add(SeqState("c", prompt_len=4, max_new_tokens=20))
    plan = sched.schedule()  # not twice in a row: a and b decode, c joins the same step
    assert [w.id for w in plan.decode] == ["a", "b"] and [w.id for w in plan.prefill] == ["c"]
    sched.update()
    assert [w.id for w in sched.schedule().decode] == ["a", "b", "c"]


@pytest.mark.parametrize("streak", [1, 3])
def test_prefill_first_loses_no_token_and_decoding_runs_after_each_streak(streak: int) -> None:
    """Arrivals at every step: each sequence still gets exactly its tokens, and no more than
    `prefill_streak` consecutive steps leave the running sequences out."""
    rng = random.Random(3)
    sched = DecodingScheduler(SchedulerLimits(max_step_tokens=64, max_seqs=6,
                                              prefill_first=True, prefill_streak=streak))
    wanted = {f"s{i}": rng.randint(1, 12) for i in range(40)}
    arrivals = list(wanted)
    generated: dict[str, int] = dict.fromkeys(wanted, 0)
    idle_decodes = longest = 0
    for _ in range(2000):
        if arrivals:
            name = arrivals.pop(0)
            sched.add(SeqState(name, rng.randint(1, 20), wanted[name]))
        if not len(sched):
            break
        running_before = len(sched.running)
        plan = sched.schedule()
        idle_decodes = idle_decodes + 1 if running_before and not plan.decode else 0
        longest = max(longest, idle_decodes)
        for work in plan.work:
            generated[work.id] += work.emits
        sched.update()
    assert generated == wanted
    assert longest == streak  # arrivals at every step use the whole streak, never more


def test_prefill_streak_lets_an_arrival_during_a_prefill_have_its_own_step_too() -> None:
    """With prefill_streak 2, c (arriving during b's prefill-only step) is prefilled alone
    as well; a third arrival then waits for the decode step."""
    sched = DecodingScheduler(SchedulerLimits(max_step_tokens=100, prefill_first=True,
                                              prefill_streak=2))
    sched.add(SeqState("a", prompt_len=5, max_new_tokens=20))
    sched.schedule()
    sched.update()
    for name in ("b", "c"):
        sched.add(SeqState(name, prompt_len=6, max_new_tokens=20))
        plan = sched.schedule()
        assert [w.id for w in plan.prefill] == [name] and not plan.decode
        sched.update()
    sched.add(SeqState("d", prompt_len=4, max_new_tokens=20))
    plan = sched.schedule()  # the streak is spent: everyone decodes, d joins the step
    assert [w.id for w in plan.decode] == ["a", "b", "c"] and [w.id for w in plan.prefill] == ["d"]


def test_prefill_streak_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_streak"):
        SchedulerLimits(prefill_streak=0)


def test_an_online_request_takes_the_seat_of_the_newest_background_sequence_once() -> None:
    sched = scheduler(max_seqs=2, max_wait_steps=1000)
    sched.add(SeqState("bg-old", 2, 50, priority=-1))
    sched.add(SeqState("bg-new", 2, 50, priority=-1))
    sched.schedule()
    sched.update()
    sched.add(SeqState("online", 2, 3))
    plan = sched.schedule()
    assert plan.preempted == ["bg-new"] and plan.admitted == ["online"]
    sched.update()
    sched.add(SeqState("online-2", 2, 3))
    plan = sched.schedule()  # bg-new waits; bg-old keeps its seat until online leaves
    assert plan.preempted == ["bg-old"] and plan.admitted == ["online-2"]
    finished = drive(sched)
    assert set(finished) == {"online", "online-2", "bg-old", "bg-new"}


def test_a_background_sequence_preempted_once_keeps_its_seat() -> None:
    sched = scheduler(max_seqs=1, max_wait_steps=1000)
    sched.add(SeqState("bg", 2, 20, priority=-1))
    sched.schedule()
    sched.update()
    sched.add(SeqState("online", 2, 2))
    assert sched.schedule().preempted == ["bg"]
    sched.update()
    while sched.running and sched.running[0].id != "bg":
        sched.schedule()
        sched.update()
    sched.add(SeqState("online-2", 2, 2))
    assert sched.schedule().preempted == []
