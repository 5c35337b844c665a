"""The device sampler (worker/execution/sampling.py): every row of a forward chosen at once
in tensor ops, a seeded row's draw the same alone or beside any others, top-k and top-p
restricting what can be drawn, and no per-row host work."""

from __future__ import annotations

import collections

import pytest
import torch

from worker.execution.sampling import RowDraws, choose_tokens, draw_key, uniforms
from worker.models.generation_params import SamplingParams


def chosen(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           indices: list[int]) -> list[int]:
    return list(choose_tokens(logits, RowDraws.of(params, seeds, indices)).tolist())


def test_greedy_rows_take_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    assert chosen(logits, [SamplingParams(4)] * 5, [1] * 5, [0] * 5) == \
        logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 400) * 2
    params = [SamplingParams(8), SamplingParams(8, temperature=0.8, seed=3),
              SamplingParams(8), SamplingParams(8, temperature=1.2, top_k=50, top_p=0.9),
              SamplingParams(8, temperature=1e-300, seed=1), SamplingParams(8, 1.0, 0.5)]
    seeds, indices = [0, 3, 2, 11, 1, 5], [0, 4, 2, 7, 1, 3]
    together = chosen(logits, params, seeds, indices)
    alone = [chosen(logits[r:r + 1], params[r:r + 1], seeds[r:r + 1], indices[r:r + 1])[0]
             for r in range(6)]
    assert together == alone
    shuffled = [3, 0, 5, 1, 4, 2]
    again = chosen(logits[shuffled], [params[r] for r in shuffled],
                   [seeds[r] for r in shuffled], [indices[r] for r in shuffled])
    assert again == [together[r] for r in shuffled]
    assert together[4] == int(logits[4].argmax())  # a tiny temperature is all but greedy


def draws(logits: torch.Tensor, params: SamplingParams, count: int) -> collections.Counter[int]:
    """`count` draws of one row of logits, at token indices 0..count-1, in one batch."""
    rows = logits.expand(count, -1)
    return collections.Counter(chosen(rows, [params] * count, [7] * count, list(range(count))))


def test_top_k_and_top_p_restrict_what_can_be_drawn() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 200)
    best = logits[0].argsort(descending=True).tolist()
    free = draws(logits, SamplingParams(8, temperature=1.0), 2000)
    assert len(free) > 20  # it samples
    top_k = draws(logits, SamplingParams(8, temperature=1.0, top_k=5), 2000)
    assert set(top_k) <= set(best[:5]) and len(top_k) == 5
    probs = torch.softmax(logits[0], -1)[best]
    nucleus = int((torch.cumsum(probs, 0) - probs < 0.5).sum())  # tokens top_p 0.5 keeps
    top_p = draws(logits, SamplingParams(8, temperature=1.0, top_p=0.5), 2000)
    assert set(top_p) <= set(best[:nucleus]) and len(top_p) > 1
    assert set(draws(logits, SamplingParams(8, 1.0, top_p=0.5, top_k=2), 500)) <= \
        set(best[:2])


def test_the_draws_follow_the_softmax_of_the_scaled_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    count = 8000
    seen = draws(logits, SamplingParams(8, temperature=0.7), count)
    expected = torch.softmax(logits[0] / 0.7, -1)
    for token in range(4):
        assert abs(seen[token] / count - float(expected[token])) < 0.02, (seen, expected)


def test_uniforms_are_in_the_open_interval_and_differ_by_key() -> None:
    keys = torch.tensor([draw_key(s, i) for s in range(4) for i in range(4)])
    u = uniforms(keys, torch.arange(5000)[None])
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert len({tuple(row[:8].tolist()) for row in u}) == 16


def test_the_batch_is_chosen_in_tensor_ops_whatever_its_size() -> None:
    """No per-row work: a batch of 16 runs the same ops as a batch of 2, and reads
    nothing back to the host."""
    from torch.profiler import ProfilerActivity, profile

    def ops(rows: int) -> collections.Counter[str]:
        logits = torch.randn(rows, 300)
        params = [SamplingParams(4, temperature=0.9, top_k=20, top_p=0.9, seed=1)] * rows
        draws = RowDraws.of(params, [1] * rows, [0] * rows)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            choose_tokens(logits, draws)
        return collections.Counter(e.name for e in prof.events())

    small, large = ops(2), ops(16)
    assert small == large
    assert large["aten::_local_scalar_dense"] == 0
    assert large["aten::topk"] == 1 and large["aten::sort"] == 0  # only the best 20 sorted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_draws_what_the_cpu_draws() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 1000)
    params = [SamplingParams(8, temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in range(8)]
    draws_ = RowDraws.of(params, list(range(8)), [5] * 8)
    assert choose_tokens(logits.cuda(), draws_).tolist() == \
        choose_tokens(logits, draws_).tolist()
