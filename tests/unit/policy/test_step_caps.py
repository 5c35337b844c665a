"""The step caps under device memory (worker/policy/step_caps.py) and the scheduler's
recompute of a step that ran out (worker/policy/decoding.py), without a model."""

from __future__ import annotations

import random

from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState
from worker.policy.step_caps import MIN_STEP_TOKENS, StepCaps


def test_a_prefill_that_ran_out_cuts_the_token_cap_to_half_of_it_down_to_a_block() -> None:
    caps = StepCaps(512, 16)
    assert caps.on_out_of_memory(tokens=300, rows=3, decoding=False)
    assert (caps.tokens, caps.seqs) == (150, 16)
    assert caps.on_out_of_memory(tokens=20, rows=1, decoding=False)
    assert caps.tokens == MIN_STEP_TOKENS
    assert caps.on_out_of_memory(tokens=16, rows=4, decoding=False)  # rows are left to cut
    assert (caps.tokens, caps.seqs) == (16, 2)
    assert not caps.on_out_of_memory(tokens=16, rows=1, decoding=False)  # as small as it gets


def test_decoding_rows_that_ran_out_cut_the_sequence_cap_to_half_of_them() -> None:
    caps = StepCaps(512, 16)
    assert caps.on_out_of_memory(tokens=12, rows=12, decoding=True)
    assert (caps.tokens, caps.seqs) == (512, 6)
    assert caps.on_out_of_memory(tokens=3, rows=3, decoding=True)
    assert caps.seqs == 1
    assert not caps.on_out_of_memory(tokens=1, rows=1, decoding=True)


def test_the_caps_double_back_after_clean_steps_up_to_the_limits() -> None:
    caps = StepCaps(512, 16, grow_after=4)
    caps.on_out_of_memory(tokens=100, rows=2, decoding=False)
    caps.on_out_of_memory(tokens=3, rows=3, decoding=True)
    assert (caps.tokens, caps.seqs) == (50, 1)
    grown = []
    for _ in range(24):
        caps.on_step()
        grown.append((caps.tokens, caps.seqs))
    assert grown[2] == (50, 1) and grown[3] == (100, 2) and grown[7] == (200, 4)
    assert grown[-1] == (512, 16) and grown.count((512, 16)) > 1  # and stays there


def test_a_step_that_did_not_run_is_recomputed_and_nothing_is_counted_twice() -> None:
    """Random steps fail (before or after update, as a launch does); every sequence still
    generates exactly its max_new_tokens, and the caps bound every later plan."""
    rng = random.Random(0)
    sched = DecodingScheduler(SchedulerLimits(max_step_tokens=64, max_seqs=8))
    for n in range(20):
        sched.add(SeqState(f"s{n}", rng.randint(1, 90), max_new_tokens=rng.randint(1, 9)))
    generated: dict[str, int] = {}
    for _ in range(5000):
        if not len(sched):
            break
        plan = sched.schedule()
        assert plan.tokens <= sched.caps.tokens and len(sched.running) <= sched.caps.seqs
        gone = sched.update()
        if rng.random() < 0.2:  # the device ran out: none of the plan's work happened
            decoding = bool(plan.decode) and rng.random() < 0.5
            works = plan.decode if decoding else plan.work
            if sched.caps.on_out_of_memory(sum(w.tokens for w in works), len(works), decoding):
                sched.recompute(works)
                gone = [s for s in gone if s.id not in {w.id for w in works}]
                works_ran = [w for w in plan.work if w not in works]
            else:
                works_ran = plan.work  # at the floor the test lets it run after all
        else:
            works_ran = plan.work
        for work in works_ran:
            generated[work.id] = generated.get(work.id, 0) + work.emits
        for seq in gone:
            assert generated[seq.id] == seq.max_new_tokens
    assert not len(sched)
