"""Offline runs of the generative workload, in this process, without Redis.

- `engine`: redbatch's own engine and scheduler (execution/generation.py,
  policy/decoding.py), every request queued at once: the ceiling the worker works towards.
- `static`: the same engine, run to completion: `cap` requests are admitted together and
  the next `cap` only once all of them have finished. A finished row leaves the decoding
  batch at once (no padding is computed for it), so this is a generous static baseline.
- `hf_static`: textbook static batching, transformers' `generate()` on `cap` left-padded
  prompts at a time: every row is computed until the batch's longest is done (its
  max_new_tokens is the batch's largest; each row is then cut at its own and at EOS).
- `generate_batch`: transformers' own continuous batching, the ContinuousBatchingManager
  that `generate_batch` runs, fed the same token ids with each request's own
  max_new_tokens (`generate_batch` takes one for all) and `max_requests_per_batch` = cap.
Greedy everywhere, so all of them should generate the same tokens; `agreement` checks it
(padding may flip a near-tie in `hf_static`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from bench.generative.workload import MAX_NEW, GenRequest
from worker.execution.generation import GenerationEngine, engine_for
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SeqState


@dataclass(slots=True)
class Run:
    seconds: float
    tokens: int
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, float]:
        return {"seconds": round(self.seconds, 3), "tokens": self.tokens,
                "tokens_per_s": round(self.tokens_per_s, 2)}


_ENGINES: dict[int, GenerationEngine] = {}  # per model: its CUDA graphs captured once


def run_engine(model: Any, requests: Sequence[GenRequest], cap: int,
               static: bool = False) -> Run:
    """redbatch's engine stepped to the end: continuous, or static (run to completion)."""
    engine = _ENGINES.get(id(model)) or _ENGINES.setdefault(id(model), engine_for(model))
    scheduler = DecodingScheduler(replace(model.scheduler_limits(), max_seqs=cap))
    queued = list(enumerate(requests))
    outputs: dict[int, list[int]] = {}
    started = time.perf_counter()
    while queued or len(scheduler):
        if not static or not len(scheduler):
            admit, queued = (queued[:cap], queued[cap:]) if static else (queued, [])
            for index, request in admit:
                engine.add(str(index), request.prompt_ids,
                           SamplingParams(max_new_tokens=request.max_new_tokens))
                scheduler.add(SeqState(str(index), len(request.prompt_ids),
                                       request.max_new_tokens))
        plan = scheduler.schedule()
        finished = engine.step(plan).finished
        for seq in scheduler.update(finished):
            done = engine.drop(seq.id)
            assert done is not None
            outputs[int(seq.id)] = list(done.text.generated)
    seconds = time.perf_counter() - started
    return Run(seconds, sum(map(len, outputs.values())), outputs)


@contextmanager
def plain_attention(lm: Any) -> Iterator[None]:
    """transformers' own sdpa for a baseline: redbatch's engine switches the model to its
    paged attention, which transformers' batching manager refuses."""
    previous = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        lm.set_attn_implementation(previous)


def run_generate_batch(model: Any, requests: Sequence[GenRequest], cap: int) -> Run:
    """transformers' ContinuousBatchingManager on the same requests (greedy)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW,
                              eos_token_id=sorted(model.eos_ids),
                              pad_token_id=sorted(model.eos_ids)[0])
    batching = ContinuousBatchingConfig(max_requests_per_batch=cap,
                                        max_batch_tokens=model.limits.max_step_tokens)
    outputs: dict[int, list[int]] = {}
    with plain_attention(model.lm), model.lm.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching,
            warmup=False) as manager:
        started = time.perf_counter()
        for index, request in enumerate(requests):
            manager.add_request(request.prompt_ids, request_id=str(index),
                                max_new_tokens=request.max_new_tokens)
        while len(outputs) < len(requests):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' batching manager stopped early")
            if result.is_finished():
                outputs[int(result.request_id)] = list(result.generated_tokens)
        seconds = time.perf_counter() - started
    return Run(seconds, sum(map(len, outputs.values())), outputs)


def _own_tokens(row: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """A padded batch row cut to what the request itself would get: its max_new_tokens,
    and up to its first EOS (kept, as the engine keeps it)."""
    row = row[:max_new_tokens]
    for index, token in enumerate(row):
        if token in eos_ids:
            return row[:index + 1]
    return row


def run_hf_static(model: Any, requests: Sequence[GenRequest], cap: int) -> Run:
    """transformers' generate() on `cap` requests at a time, left-padded, to completion."""
    import torch

    pad = sorted(model.eos_ids)[0]
    outputs: dict[int, list[int]] = {}
    started = time.perf_counter()
    for first in range(0, len(requests), cap):
        group = requests[first:first + cap]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in group])
        with torch.inference_mode():
            out = model.lm.generate(input_ids=ids.to(model.device),
                                    attention_mask=mask.to(model.device), do_sample=False,
                                    max_new_tokens=max(r.max_new_tokens for r in group),
                                    eos_token_id=sorted(model.eos_ids), pad_token_id=pad)
        for offset, request in enumerate(group):
            outputs[first + offset] = _own_tokens(out[offset, width:].tolist(),
                                                  request.max_new_tokens, model.eos_ids)
    seconds = time.perf_counter() - started
    return Run(seconds, sum(map(len, outputs.values())), outputs)


def agreement(first: Run, second: Run) -> float:
    """The share of requests whose generated tokens are identical in both runs."""
    common = first.outputs.keys() & second.outputs.keys()
    same = sum(first.outputs[i] == second.outputs[i] for i in common)
    return same / len(common) if common else 0.0
