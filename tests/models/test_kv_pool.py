"""The paged KV pool (worker/execution/kv_pool.py): block tables, the slots a forward writes
and reads, its mask, and that the engine's memory is the pool whatever the batch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.generation import GenerationEngine, engine_for
from worker.execution.kv_pool import BLOCK_TOKENS, TRASH_SLOT, KVPool, KVPoolFull
from worker.execution.step_layouts import StepLayout
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")


def pool(tokens: int = 64) -> KVPool:
    return KVPool(layers=2, kv_heads=1, head_dim=2, tokens=tokens, dtype=torch.float32,
                  device=CPU)


def test_block_tables_grow_by_blocks_and_give_them_back_lowest_first() -> None:
    kv = pool(4 * BLOCK_TOKENS)
    a: list[int] = []
    b: list[int] = []
    kv.reserve(a, 1)
    kv.reserve(a, BLOCK_TOKENS)  # still one block
    kv.reserve(b, BLOCK_TOKENS + 1)
    assert a == [1] and b == [2, 3]  # block 0 is the trash block, never handed out
    kv.release(a)
    assert a == [] and kv.free_tokens == 2 * BLOCK_TOKENS
    kv.reserve(a, 2 * BLOCK_TOKENS)
    assert a == [1, 4]


def test_a_pool_that_cannot_hold_the_tokens_says_so() -> None:
    kv = pool(2 * BLOCK_TOKENS)
    table: list[int] = []
    with pytest.raises(KVPoolFull, match="need 3 more blocks; 2 are free"):
        kv.reserve(table, 3 * BLOCK_TOKENS)
    assert table == [] and kv.free_tokens == 2 * BLOCK_TOKENS


def test_slots_follow_the_block_table() -> None:
    kv = pool()
    assert kv.slots([3, 1], BLOCK_TOKENS + 2).tolist() == (
        list(range(3 * BLOCK_TOKENS, 4 * BLOCK_TOKENS)) + [BLOCK_TOKENS, BLOCK_TOKENS + 1])


def test_a_layout_left_pads_queries_and_right_pads_what_each_row_reads() -> None:
    kv = pool()
    tables = [[1], [2]]
    layout = StepLayout(kv, tables, starts=[0, 4], ends=[3, 5])  # a 3-token chunk, a decode
    assert (layout.rows, layout.queries, layout.length) == (2, 3, 5)
    read = layout.read.view(2, 5).tolist()
    write = layout.write.view(2, 3).tolist()
    base0, base1 = BLOCK_TOKENS, 2 * BLOCK_TOKENS
    assert read[0] == [base0, base0 + 1, base0 + 2, TRASH_SLOT, TRASH_SLOT]
    assert read[1] == [base1 + i for i in range(5)]
    assert write == [[base0, base0 + 1, base0 + 2], [TRASH_SLOT, TRASH_SLOT, base1 + 4]]
    assert layout.positions.tolist() == [[0, 1, 2], [4, 4, 4]]
    seen = layout.mask(torch.float32)[:, 0] == 0
    assert seen[0].tolist() == [[True, False, False, False, False],
                                [True, True, False, False, False],
                                [True, True, True, False, False]]
    assert seen[1, -1].tolist() == [True] * 5  # the decode sees its 4 tokens and itself


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path: Path = build_tiny_lm(tmp_path_factory.mktemp("tiny-gpt2"))
    yield AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_the_engine_gives_every_block_back_and_stays_within_its_pool(
        tiny: tuple[Any, Any]) -> None:
    """Thirty requests through a pool of 8 blocks: the scheduler's budget keeps the
    engine inside it (preempting as needed), and every block comes back."""
    lm, tokenizer = tiny
    limits = SchedulerLimits(max_step_tokens=64, max_seqs=4, kv_budget_bytes=6 * BLOCK_TOKENS)
    engine = GenerationEngine(lm, tokenizer, CPU, [tokenizer.eos_token_id],
                              kv_tokens=limits.kv_tokens + limits.max_seqs * BLOCK_TOKENS)
    everything = engine.pool.free_tokens
    scheduler = DecodingScheduler(limits)
    for i in range(30):
        prompt = [(7 * i + j) % 300 + 1 for j in range(5 + i % 20)]
        engine.add(str(i), prompt, SamplingParams(max_new_tokens=10 + i % 30))
        scheduler.add(SeqState(str(i), len(prompt), 10 + i % 30))
    preempted = 0
    while len(scheduler):
        plan = scheduler.schedule()
        preempted += len(plan.preempted)
        for seq in scheduler.update(engine.step(plan).finished):
            assert len(engine.drop(seq.id).text.generated) >= 1  # type: ignore[union-attr]
    assert preempted > 0
    assert engine.pool.free_tokens == everything


def test_a_worker_lowers_its_kv_cache_to_the_watermark_or_refuses_to_start(
        tmp_path: Path) -> None:
    from worker.app import StartupError, fit_kv_cache
    from worker.models.generative import CausalLM
    from worker.policy.governor import MemoryReading

    model = CausalLM(str(build_tiny_lm(tmp_path)), kv_cache_bytes=64 << 20, max_step_tokens=64)
    model.load(CPU)
    per_token = model.scheduler_limits().bytes_per_token  # 1 KiB for the tiny model
    fit_kv_cache(model, MemoryReading(used=100 << 20, limit=1 << 30), 0.9)
    assert model.limits.kv_budget_bytes == 64 << 20  # room enough: unchanged
    fit_kv_cache(model, MemoryReading(used=(900 << 20) - (1 << 20), limit=1000 << 20), 0.9)
    assert model.limits.kv_budget_bytes == 1 << 20
    assert engine_for(model).pool.free_tokens >= (1 << 20) // per_token
    with pytest.raises(StartupError, match=r"the KV cache would get 0 MiB \(32 tokens\)"):
        fit_kv_cache(model, MemoryReading(used=(900 << 20) - 32 * per_token,
                                          limit=1000 << 20), 0.9)


def test_the_weights_and_the_kv_pool_are_in_the_model_s_dtype(tmp_path: Path) -> None:
    """The `dtype` setting (model.dtype, set before load) reaches the weights, the pool and
    the KV budget's bytes per token."""
    from worker.models.generative import CausalLM

    path = str(build_tiny_lm(tmp_path))
    per_token = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = CausalLM(path, kv_cache_bytes=1 << 20)
        model.dtype = dtype
        model.load(CPU)
        engine = engine_for(model)
        assert model.lm.dtype == engine.pool.keys[0].dtype == dtype
        per_token[dtype] = model.scheduler_limits().bytes_per_token
        assert engine.pool.free_tokens >= (1 << 20) // per_token[dtype]
        engine.add("a", [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.7, seed=1))
        scheduler = DecodingScheduler(model.scheduler_limits())
        scheduler.add(SeqState("a", 3, 4))
        while len(scheduler):
            scheduler.update(engine.step(scheduler.schedule()).finished)
        assert len(engine.seqs["a"].text.generated) == 4
    assert per_token[torch.bfloat16] * 2 == per_token[torch.float32]
