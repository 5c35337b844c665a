"""n choices of one prompt through the engine (execution/forks.py): the forks take the
prompt's whole blocks from the first choice instead of computing them, and each choice,
seed + j, gets the tokens of the same request run alone with that seed; the rows and
layouts as on a CPU and as on a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

PROMPT = "the quick brown fox jumps over the lazy dog, " * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def run(tiny: tuple[Any, Any], seeds: list[int], forked: bool, gpu_shapes: bool,
        chunk: int = 512) -> tuple[list[list[int]], GenerationEngine]:
    """The choices of PROMPT with these seeds, as the generate loop admits them: the first
    the source of the others (when `forked`)."""
    lm, tokenizer = tiny
    engine = GenerationEngine(lm, tokenizer, torch.device("cpu"), [tokenizer.eos_token_id],
                              gpu_shapes=gpu_shapes)
    scheduler = DecodingScheduler(SchedulerLimits(max_step_tokens=chunk))
    ids = tokenizer(PROMPT).input_ids
    for j, seed in enumerate(seeds):
        source = "c0" if forked and j else None
        params = SamplingParams(12, 1.0, seed=seed, logprobs=2)
        engine.add(f"c{j}", ids, params, fork_of=source)
        scheduler.add(SeqState(f"c{j}", len(ids), 12, after=source))
    done: dict[str, list[int]] = {}
    while len(scheduler):
        for seq in scheduler.update(engine.step(scheduler.schedule()).finished):
            done[seq.id] = engine.seqs[seq.id].text.generated
            engine.drop(seq.id)
    return [done[f"c{j}"] for j in range(len(seeds))], engine


@pytest.mark.parametrize("gpu_shapes", [False, True], ids=["row-by-row", "gpu-shaped"])
def test_each_fork_equals_its_seed_alone_and_shares_the_prompt(
        tiny: tuple[Any, Any], gpu_shapes: bool) -> None:
    prompt_len = len(tiny[1](PROMPT).input_ids)
    alone = [run(tiny, [seed], False, gpu_shapes)[0][0] for seed in (5, 6, 7)]
    choices, engine = run(tiny, [5, 6, 7], True, gpu_shapes)
    assert choices == alone and len({tuple(c) for c in choices}) > 1
    assert engine.shared_tokens == 2 * ((prompt_len - 1) // 16 * 16) > 0
    assert engine.pool.free_tokens == run(tiny, [5], False, gpu_shapes)[1].pool.free_tokens


def test_forks_after_a_chunked_prefill_and_unforked_rows_are_unchanged(
        tiny: tuple[Any, Any]) -> None:
    choices, engine = run(tiny, [5, 6, 7], True, False, chunk=24)
    assert choices == run(tiny, [5, 6, 7], False, False, chunk=24)[0]
    assert engine.shared_tokens > 0
