"""bench/generative/constrained.py on a tiny input (the tiny GPT-2, 4 prompts): both runs
generate, the mix masks its constrained rows, and each constrained answer either validates
against the schema or was cut by max_new_tokens. CI measures nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from bench.generative.constrained import constrained_mix
from bench.generative.workload import build_workload
from tests.rigs.tiny_lm import build_tiny_lm
from worker.models.generative import CausalLM


def test_the_constrained_mix_runs_on_a_tiny_input(tmp_path: Path) -> None:
    model = CausalLM(path=str(build_tiny_lm(tmp_path, n_positions=1024)), max_seqs=4)
    model.dtype = torch.float32
    model.load(torch.device("cpu"))
    requests = [replace(r, max_new_tokens=min(r.max_new_tokens, 24))  # seconds, not more
                for r in build_workload(model, 4)]
    results = constrained_mix(model, requests, [2])["2"]
    plain, mixed = results["unconstrained"], results["mixed"]
    assert plain["tokens"] > 0 and mixed["tokens"] > 0 and results["ratio"] > 0
    assert plain["masked_steps"] == 0 and mixed["masked_steps"] > 0
    assert mixed["mask_ms_per_masked_step"] > 0 and mixed["constrained"] == 2
    assert mixed["valid"] + mixed["cut_by_length"] == mixed["constrained"]

