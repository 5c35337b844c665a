"""`python -m bench.latency_bench` for G2, G4 and G5: the goals' loads and rules without
processes, then a seconds-long run on real worker processes (it measures nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.latency_bench_goals import (
    COST,
    DRIFT_FACTOR,
    ECHO_DEVICE,
    G5_OPTIONS,
    MINILM_COST,
    MINILM_DEVICE,
    baselines,
    configs,
    goals,
    sized_payload,
)
from bench.latency_bench_report import g4_settled, g5_met, render

REPO = Path(__file__).resolve().parent.parent


def test_the_goals_loads_follow_the_simulator() -> None:
    g2, g4, g5 = goals(1000.0, 20.0, ["G2", "G4", "G5"], c5=800.0)
    assert [(p.seconds, p.rate_per_s) for p in g2.phases] == [(20.0, 250.0)]
    assert [(p.seconds, p.rate_per_s) for p in g4.phases] == [(20.0, 500.0), (60.0, 500.0)]
    assert [(p.seconds, p.rate_per_s) for p in g5.phases] == [(20.0, 600.0)]
    assert [g.name for g in goals(1000.0, 20.0, ["G5", "G1"])] == ["G1 step load",
                                                                   "G5 mixed lengths"]
    with pytest.raises(ValueError, match="G6"):
        goals(1000.0, 20.0, ["G6"])


def test_the_drift_falls_after_the_warm_up_and_the_first_phase() -> None:
    g4 = goals(1000.0, 2.0, ["G4"])[0]
    sent_at, lengths = g4.arrivals(seed=1)
    assert lengths is None and sent_at == g4.arrivals(seed=1)[0]  # the same for every run
    options = g4.settings(COST, 300, sent_at)["model_options"]
    assert options["drift_after_requests"] == 300 + sum(1 for at in sent_at if at < 2.0)
    assert options["drift_factor"] == DRIFT_FACTOR and options["delay_ms"] == 10


def test_g5_sends_two_peaked_payloads_of_their_exact_length() -> None:
    g5 = goals(1000.0, 2.0, ["G5"])[0]
    sent_at, lengths = g5.arrivals(seed=1)
    assert lengths is not None and len(lengths) == len(sent_at)
    assert {n <= 16 for n in lengths} == {True, False}
    assert all(8 <= n <= 16 or 96 <= n <= 128 for n in lengths)
    assert [len(p) for p in ECHO_DEVICE.payloads(lengths)] == lengths and len(sized_payload(8)) == 8
    assert g5.settings(COST, 0, sent_at)["model_options"] == G5_OPTIONS


def test_on_minilm_every_goal_sends_the_two_peaked_mix_and_g4_is_refused() -> None:
    chosen = goals(100.0, 2.0, ["G1", "G2", "G3", "G5"], device=MINILM_DEVICE)
    assert [g.name.split()[0] for g in chosen] == ["G1", "G2", "G3", "G5"]
    for goal in chosen:
        sent_at, lengths = goal.arrivals(seed=1)
        assert lengths is not None and len(lengths) == len(sent_at)
        assert all(8 <= n <= 16 or 96 <= n <= 128 for n in lengths)
        assert goal.settings(MINILM_COST, 0, sent_at) == MINILM_COST  # no echo options
    assert chosen[-1].phases[0].rate_per_s == 75.0  # G5 at 75 % of MiniLM's own C
    with pytest.raises(ValueError, match="echo cost model only"):
        goals(100.0, 2.0, ["G4"], device=MINILM_DEVICE)
    assert "minilm" in configs(250.0, False, MINILM_COST)["redbatch"]["model"]
    assert len(MINILM_DEVICE.sample_lengths() or []) == 64


def test_the_cork_baseline_is_one_of_the_configurations() -> None:
    assert baselines(100.0)["bentoml_cork"] == {"batch_controller": "cork",
                                                "controller_target_ms": 100.0,
                                                "max_wait_ms": 0.0}
    assert "bentoml_cork" in configs(100.0, False)


def test_the_rules_of_g4_and_g5() -> None:
    assert g4_settled([50, 50, 150, 120, 101, 90, 99], change=2, target_ms=100)
    assert not g4_settled([50, 50, 150, 120, 101, 90, 101], change=2, target_ms=100)
    assert not g4_settled([50, 50, 90], change=2, target_ms=100)  # nothing to check
    assert not g4_settled([50, 50, 0, 0, 0, 0], change=2, target_ms=100, unanswered=9)
    fed = {"0": {"p99_ms": 40.0, "sent": 10, "served": 10},
           "1": {"p99_ms": 90.0, "sent": 5, "served": 5}}
    assert g5_met(fed, 100) == (True, True)
    assert g5_met({**fed, "1": {"p99_ms": 120.0, "sent": 5, "served": 4}}, 100) == (False,
                                                                                 False)


@pytest.mark.slow
def test_g2_g4_g5_run_on_real_processes(tmp_path: Path) -> None:
    out = tmp_path / "goals.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.latency_bench", "--capacity", "200", "--phase-s", "2",
         "--goals", "G2,G4,G5", "--only", "static wait 0 batch 32", "--paced-warmup",
         "--reply-timeout-s", "10", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    name = "static wait 0 batch 32"
    assert results["G2 light load"][name]["p50_ms"] > 0
    before, after = results["G4 drift"][name]["compute_ms_per_phase"]
    assert after >= 1.3 * before  # the echo model drifted, after the first phase
    buckets = results["G5 mixed lengths"][name]["buckets"]
    assert set(buckets) == {"0", "1"} and all(b["served"] == b["sent"] > 0
                                              for b in buckets.values())
    markdown = render(results)
    assert "G2 light load" in markdown and "G4 drift" in markdown and "b1:" in markdown


def test_minilm_requests_have_exactly_their_token_length() -> None:
    import msgpack
    import torch

    from bench.latency_bench_goals import text_payload
    from worker.models.minilm import MiniLMModel

    model = MiniLMModel()
    model.load(torch.device("cpu"))
    for tokens in (8, 16, 96, 128):
        payload = text_payload(tokens)
        assert model.prepare(msgpack.unpackb(payload), len(payload)).length == tokens
