"""Drive the batched decoding engine and its scheduler step by step, as the generate loop
(worker/pipeline/generate.py) does, without Redis or threads, and keep a note of how each
token was chosen: the path (a prefill alone or a padded decode batch), the batch width,
whether the sequence had been preempted, and its logits next to the reference's token.

Used by bench/generative/exactness.py and tests/models/test_smollm2_exactness.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.execution.generation import GenerationEngine
from worker.execution.staging import EngineSeq, Forward
from worker.execution.step_results import Launched
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState, StepPlan


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: int  # the scheduler step it arrives at
    kind: str = "raw"  # "raw" (a prompt) or "chat" (messages through the chat template)


@dataclass(frozen=True, slots=True)
class Emitted:
    """How the engine chose one greedy token."""

    token: int
    top: float  # its logit: the row's maximum
    expected: float | None  # the logit of the reference's token at this index, if known
    path: str  # "prefill" (the sequence alone) or "decode" (one row of a padded batch)
    width: int  # rows in that forward
    preempted: bool  # the sequence had been preempted (and recomputed) before this token


@dataclass(slots=True)
class Served:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    emitted: dict[str, list[Emitted]] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    chunks: dict[str, int] = field(default_factory=dict)  # prefill forwards per sequence
    steps: int = 0
    widest: int = 0  # the most sequences decoded in one forward
    seconds: float = 0.0


class RecordingEngine(GenerationEngine):
    """The engine, unchanged, with a note of the logits behind every token it samples."""

    def __init__(self, lm: Any, tokenizer: Any, device: torch.device, eos_ids: Iterable[int],
                 expected: Mapping[str, Sequence[int]] | None = None,
                 gpu_shapes: bool | None = None) -> None:
        super().__init__(lm, tokenizer, device, eos_ids, gpu_shapes=gpu_shapes)
        self.expected = expected or {}
        self.emitted: dict[str, list[Emitted]] = {}
        self.chunks: dict[str, int] = {}
        self.was_preempted: set[str] = set()

    def launch(self, plan: StepPlan, on_prefilled: Any = None) -> Launched:
        self.was_preempted.update(plan.preempted)
        return super().launch(plan, on_prefilled)

    def _forward(self, forward: Forward) -> torch.Tensor:
        logits = super()._forward(forward)
        if forward.batched:
            for row, seq in enumerate(forward.seqs):
                self._note(seq, logits[row], "decode", len(forward.seqs))
            return logits
        for row, (seq, work) in enumerate(zip(forward.seqs, forward.works, strict=True)):
            self.chunks[seq.id] = self.chunks.get(seq.id, 0) + 1  # packed on a GPU
            if work.end == len(seq.prompt_ids) + len(seq.text.generated):
                self._note(seq, logits[row], "prefill", len(forward.seqs))
        return logits

    def _note(self, seq: EngineSeq, logits: torch.Tensor, path: str, width: int) -> None:
        in_flight = self.flight is not None and seq.id in self.flight.rows  # overlapped
        index = len(seq.text.generated) + in_flight
        expected = self.expected.get(seq.id, ())
        row = logits.float()
        value = float(row[expected[index]]) if index < len(expected) else None
        self.emitted.setdefault(seq.id, []).append(Emitted(
            int(torch.argmax(row)), float(row.max()), value, path, width,
            seq.id in self.was_preempted))


def arrivals_by_step(requests: Iterable[Request]) -> dict[int, list[Request]]:
    steps: dict[int, list[Request]] = {}
    for request in requests:
        steps.setdefault(request.arrival, []).append(request)
    return steps


def serve(engine: RecordingEngine, limits: SchedulerLimits, requests: Sequence[Request],
          overlap: bool = False) -> Served:
    """Greedy decoding of every request, continuous-batched, until all are done; with
    `overlap`, step n + 1 is launched before step n finishes, as the generate loop does on a
    GPU (a sequence that ended in step n rides along in step n + 1, its token dropped)."""
    sched = DecodingScheduler(limits)
    arrivals = arrivals_by_step(requests)
    served, last = Served(), max(arrivals)
    states: dict[str, SeqState] = {}
    previous: Launched | None = None
    started = time.perf_counter()
    while served.steps <= last or len(sched) or previous is not None:
        for request in arrivals.get(served.steps, []):
            engine.add(request.id, request.prompt_ids, SamplingParams(request.max_new_tokens))
            states[request.id] = SeqState(request.id, len(request.prompt_ids),
                                          request.max_new_tokens)
            sched.add(states[request.id])
        served.steps += 1
        plan = sched.schedule()
        launched = None
        if plan:
            served.widest = max(served.widest, len(plan.decode))
            sched.update()  # counted now: one at its max_new_tokens leaves
            launched = engine.launch(plan)
        done, previous = (previous, launched) if overlap else (launched, None)
        for delta in engine.finish(done).deltas if done is not None else []:
            if delta.finish_reason:
                sched.remove(delta.id)
                seq = engine.drop(delta.id)
                assert seq is not None
                served.tokens[delta.id] = seq.text.generated
                served.preemptions[delta.id] = states[delta.id].preemptions
    served.seconds = time.perf_counter() - started
    served.emitted, served.chunks = engine.emitted, engine.chunks
    return served
