"""choose_tokens (worker/execution/sampling.py): a decode step's rows chosen together pick what
choose_token picks row by row (greedy, seeded, unseeded), with one host copy for greedy rows."""

from __future__ import annotations

import torch

from worker.execution.sampling import SamplingParams, choose_token, choose_tokens


def test_rows_chosen_together_equal_rows_chosen_one_by_one() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(8), SamplingParams(8, temperature=0.8, seed=3),
              SamplingParams(8), SamplingParams(8, temperature=1.2, top_k=5, top_p=0.9),
              SamplingParams(8, temperature=1e-300, seed=1), SamplingParams(8)]
    indices = [0, 4, 2, 7, 1, 3]
    alone = [choose_token(logits[r], params[r], indices[r], torch.Generator().manual_seed(r))
             for r in range(6)]
    together = choose_tokens(logits, params, indices,
                             [torch.Generator().manual_seed(r) for r in range(6)])
    assert together == alone


def test_greedy_rows_cost_one_host_copy() -> None:
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(16, 300)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        choose_tokens(logits, [SamplingParams(4)] * 16, [0] * 16, [None] * 16)
    names = [e.name for e in prof.events()]
    assert names.count("aten::argmax") == 1
    assert names.count("aten::_local_scalar_dense") == 0  # no int(tensor) per row
