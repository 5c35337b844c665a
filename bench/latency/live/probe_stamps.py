"""The probe's stamps: a few of the pipeline's methods (intake, compute loop, reply writer)
wrapped to record when each read, batch, write and answer happened, in EVENTS. Installed in
the probed worker's process only (`python -m bench.latency.live.probe worker ...`); the
worker's own code is untouched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

EVENTS: dict[str, list[Any]] = {"reads": [], "refused": [], "batches": [], "writes": [],
                                "answers": [], "policy": []}


def _now_ms() -> float:
    return time.time() * 1000


def install() -> None:
    """Wrap the intake, the compute loop and the reply writer to stamp times."""
    from worker.pipeline import compute, intake, reply

    admit, write, complete = intake.Intake.admit, reply.ReplyWriter.write, \
        compute.ComputeLoop.complete

    def timed_admit(self: Any, entries: Sequence[Any]) -> None:
        start = _now_ms()
        admit(self, entries)
        ids = [int(e.id.partition("-")[0]) for e in entries]
        EVENTS["reads"].append((start, _now_ms(), len(ids), min(ids, default=0),
                                max(ids, default=0)))

    def timed_write(self: Any, answers: list[Any]) -> None:
        start = _now_ms()
        write(self, answers)
        end = _now_ms()
        EVENTS["writes"].append((start, end, len(answers)))
        for a in answers:
            EVENTS["answers"].append((a.enqueued_ms, end, a.status, a.entry_id))

    def timed_complete(self: Any, running: Any) -> Any:
        answers = complete(self, running)
        batch = running.batch
        enq = [p.enqueued_ms for p in batch.members]
        EVENTS["batches"].append((self.instance, running.started_ms, running.compute_s * 1000,
                                  _now_ms(), len(enq), min(enq, default=0), max(enq, default=0),
                                  batch.reason, batch.slack_ms))
        return answers

    intake.Intake.admit = timed_admit  # type: ignore[method-assign]
    reply.ReplyWriter.write = timed_write  # type: ignore[method-assign]
    compute.ComputeLoop.complete = timed_complete  # type: ignore[method-assign]
    _wrap_read_time(reply)
    _wrap_refusals(intake)


def _wrap_read_time(reply: Any) -> None:
    """Stamp the answers the intake writes itself (refusals, invalid entries)."""
    read_time_write = reply.ReadTimeAnswers.write

    def timed_read_time(self: Any, answers: list[Any]) -> None:
        read_time_write(self, answers)
        end = _now_ms()
        EVENTS["answers"].extend((a.enqueued_ms, end, a.status, a.entry_id) for a in answers)

    reply.ReadTimeAnswers.write = timed_read_time


def _wrap_refusals(intake: Any) -> None:
    """Stamp each refusal's read and decision times."""
    queue_or_refuse = intake.Intake._queue_or_refuse

    def timed(self: Any, pending: Any, now_ms: int, refused: list[Any]) -> None:
        before = len(refused)
        queue_or_refuse(self, pending, now_ms, refused)
        if len(refused) > before:
            EVENTS["refused"].append((int(pending.entry_id.partition("-")[0]), now_ms,
                                      _now_ms()))
        policy = self.targeted.policy
        if len(EVENTS["policy"]) < 100000 and now_ms % 50 == 0:
            EVENTS["policy"].append((now_ms, policy.margin.ms, policy.model.ratio.value(1.0),
                                     policy.model.fit(0).fixed, policy.model.fit(0).per_token,
                                     len(self.batcher),
                                     [round(b - now_ms, 1) for b in policy.busy_until_ms]))

    intake.Intake._queue_or_refuse = timed
    admit = intake.TargetedDispatch.admit

    def timed_admit(self: Any, batcher: Any, pending: Any, now_ms: float) -> Any:
        decision = admit(self, batcher, pending, now_ms)
        EVENTS.setdefault("admissions", []).append((pending.entry_id, now_ms, decision.admit,
                                                    decision.predicted_ms))
        return decision

    intake.TargetedDispatch.admit = timed_admit
