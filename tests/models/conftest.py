"""SmolLM2, loaded once for every test of this folder that needs the real weights (the
load takes about 15 s; a module-scoped copy each paid it again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2() -> Iterator[Any]:
    from bench.generative.exactness import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine is shared
    try:
        yield load_model()
    finally:
        torch.set_num_threads(threads)


def six_decoding(tiny: tuple[Any, Any], params_of: Callable[[int], Any]) -> tuple[Any, Any]:
    """An engine whose next plan is six rows decoding together (their params by row), three
    steps in: (engine, that plan), for the tests that count a decode step's copies."""
    from worker.execution.generation import GenerationEngine
    from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id])
    scheduler = DecodingScheduler(SchedulerLimits())
    for i in range(6):
        params = params_of(i)
        ids = tokenizer(f"hello redis {i}").input_ids
        engine.add(str(i), ids, params)
        scheduler.add(SeqState(str(i), len(ids), params.max_new_tokens))
    for _ in range(3):
        scheduler.update(engine.step(scheduler.schedule()).finished)
    plan = scheduler.schedule()
    assert len(plan.decode) == 6 and not plan.prefill
    return engine, plan
