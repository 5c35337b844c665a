"""The engine's attention function (worker/execution/paged_attention.py) against plain SDPA
on dense tensors: random histories in randomly assigned blocks, random new-token counts
(decodes, chunks on top of a cache, whole prompts), grouped KV heads, sliding windows; and
that it is what the engine's forwards actually run."""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.kv_pool import BLOCK_TOKENS, KVPool
from worker.execution.paged_attention import NAME, paged_attention, stepping
from worker.execution.step_layouts import StepLayout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")
LAYERS, KV_HEADS, DIM = 2, 2, 8


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    window: int | None) -> torch.Tensor:
    """Plain SDPA over one row's full keys and values: q [heads, n, dim] at positions
    [start, start + n), k and v [kv_heads, start + n, dim]; returns [n, heads, dim]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    q_pos = torch.arange(start, start + q.shape[1])[:, None]
    k_pos = torch.arange(k.shape[1])[None]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)
    return out[0].transpose(0, 1)


def random_tables(rng: random.Random, pool: KVPool, ends: list[int]) -> list[list[int]]:
    """Block tables drawn in a shuffled order from the pool's free blocks."""
    free = list(range(1, pool.blocks))
    rng.shuffle(free)
    tables = []
    for end in ends:
        need = -(-end // BLOCK_TOKENS)
        tables.append([free.pop() for _ in range(need)])
    return tables


def cached_rows(rng: random.Random, starts: list[int], ends: list[int], spare: int = 64,
                unwritten: float | None = None
                ) -> tuple[KVPool, list[list[int]], int, list[torch.Tensor], list[torch.Tensor]]:
    """A pool whose rows hold, in random blocks of one random layer, their keys and values
    up to `starts` (the cache so far, as earlier steps wrote it; every other slot but the
    trash block's set to `unwritten` if given); each row's full keys and values up to
    `ends`: (pool, tables, layer, keys, values)."""
    pool = KVPool(LAYERS, KV_HEADS, DIM, tokens=sum(ends) + spare, dtype=torch.float32,
                  device=CPU)
    if unwritten is not None:
        for tensor in (*pool.keys, *pool.values):
            tensor[BLOCK_TOKENS:] = unwritten
    tables = random_tables(rng, pool, ends)
    layer = rng.randrange(LAYERS)
    full_k = [torch.randn(KV_HEADS, e, DIM) for e in ends]
    full_v = [torch.randn(KV_HEADS, e, DIM) for e in ends]
    for table, start, k, v in zip(tables, starts, full_k, full_v, strict=True):
        history = pool.slots(table, start)
        pool.keys[layer][history] = k[:, :start].transpose(0, 1)
        pool.values[layer][history] = v[:, :start].transpose(0, 1)
    return pool, tables, layer, full_k, full_v


def check_random_layout(rng: random.Random, heads: int, window: int | None) -> None:
    rows = rng.randint(1, 5)
    starts = [rng.choice([0, rng.randint(0, 40)]) for _ in range(rows)]
    ends = [s + rng.choice([1, 1, rng.randint(1, 20)]) for s in starts]
    pool, tables, layer, full_k, full_v = cached_rows(rng, starts, ends)
    layout = StepLayout(pool, tables, starts, ends)
    queries = layout.queries
    q = torch.randn(rows, heads, queries, DIM)
    new_k, new_v = torch.zeros(rows, KV_HEADS, queries, DIM), torch.zeros(
        rows, KV_HEADS, queries, DIM)
    for row, (start, end) in enumerate(zip(starts, ends, strict=True)):  # left-padded rows
        new_k[row, :, queries - (end - start):] = full_k[row][:, start:]
        new_v[row, :, queries - (end - start):] = full_v[row][:, start:]
    module = SimpleNamespace(layer_idx=layer)
    with stepping(layout):
        out, _ = paged_attention(module, q, new_k, new_v, None, sliding_window=window)
    assert layout.attended == 1
    for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
        first = queries - (end - start)
        expected = dense_reference(q[row, :, first:], full_k[row], full_v[row], start, window)
        torch.testing.assert_close(out[row, first:], expected, atol=1e-5, rtol=1e-5)
        assert not out[row, :first].any(), "padded queries get zeros"
        slots = pool.slots(tables[row], end)  # and the pool now holds the whole row
        torch.testing.assert_close(pool.keys[layer][slots], full_k[row].transpose(0, 1))
        torch.testing.assert_close(pool.values[layer][slots], full_v[row].transpose(0, 1))


@pytest.mark.parametrize(("heads", "window"), [(2, None), (6, None), (4, 7)])
def test_paged_attention_equals_plain_sdpa_on_random_layouts(heads: int,
                                                             window: int | None) -> None:
    rng = random.Random(heads * 100 + (window or 0))
    torch.manual_seed(heads)
    for _ in range(40):
        check_random_layout(rng, heads, window)


def test_the_engine_s_forwards_run_the_paged_attention_and_generate_runs_sdpa(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.execution import paged_attention as module
    from worker.execution.generation import GenerationEngine
    from worker.models.generation_params import SamplingParams
    from worker.policy.decoding import StepPlan, Work

    path = build_tiny_lm(tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calls: list[bool] = []
    real = module.attend
    monkeypatch.setattr(module, "attend", lambda *a, **k: calls.append(True) or real(*a, **k))
    engine = GenerationEngine(lm, tokenizer, CPU, [tokenizer.eos_token_id])
    assert lm.config._attn_implementation == NAME
    engine.add("a", [5, 6, 7], SamplingParams(max_new_tokens=4))
    engine.step(StepPlan(prefill=[Work("a", 0, 3, True)]))
    assert len(calls) == lm.config.n_layer  # one row, every layer
    calls.clear()
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                    do_sample=False, pad_token_id=0)
    assert not calls, "without a step layout the model runs transformers' sdpa"
