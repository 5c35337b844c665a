"""`python -m bench.latency.live` for G2, G4 and G5: the goals' loads and rules without
processes, then a seconds-long run on real worker processes (it measures nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.common.processes import Workers
from bench.latency.live.drifting import DriftingMiniLM, drift_sleep_s
from bench.latency.live.goals import (
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
from bench.latency.live.open_loop import Sample, refusals
from bench.latency.live.report import g4_settled, g5_met, render
from tests.rigs.paths import REPO_ROOT

REPO = REPO_ROOT


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


def test_on_minilm_every_goal_sends_the_two_peaked_mix() -> None:
    chosen = goals(100.0, 2.0, ["G1", "G2", "G3", "G4", "G5"], device=MINILM_DEVICE)
    assert [g.name.split()[0] for g in chosen] == ["G1", "G2", "G3", "G4", "G5"]
    for goal in chosen:
        sent_at, lengths = goal.arrivals(seed=1)
        assert lengths is not None and len(lengths) == len(sent_at)
        assert all(8 <= n <= 16 or 96 <= n <= 128 for n in lengths)
        if goal.drift_at_s is None:
            assert goal.settings(MINILM_COST, 0, sent_at, MINILM_DEVICE) == MINILM_COST
    assert chosen[-1].phases[0].rate_per_s == 75.0  # G5 at 75 % of MiniLM's own C
    assert "minilm" in configs(250.0, False, MINILM_COST)["redbatch"]["model"]
    assert len(MINILM_DEVICE.sample_lengths() or []) == 64


def test_minilm_drifts_as_the_plugin_that_keeps_its_stream() -> None:
    g4 = goals(100.0, 2.0, ["G4"], device=MINILM_DEVICE)[0]
    sent_at, _ = g4.arrivals(seed=1)
    settings = g4.settings(MINILM_COST, 30, sent_at, MINILM_DEVICE)
    assert settings["model"] == "bench.latency.live.drifting:DriftingMiniLM"
    assert settings["model_name"] == "minilm"  # the stream key of every other goal
    assert settings["model_options"] == {
        "drift_after_requests": 30 + sum(1 for at in sent_at if at < 2.0),
        "drift_factor": DRIFT_FACTOR}
    assert Workers("redis://x", "ns", 1, REPO, **settings).stream.endswith(":minilm")


def test_the_drifting_minilm_sleeps_the_difference_once_drifted() -> None:
    assert drift_sleep_s(0.02, drifted=False, factor=1.5) == 0.0
    assert drift_sleep_s(0.02, drifted=True, factor=1.5) == pytest.approx(0.01)
    assert drift_sleep_s(0.02, drifted=True, factor=1.0) == 0.0
    with pytest.raises(ValueError, match="drift_factor"):
        DriftingMiniLM(drift_factor=0.5)
    with pytest.raises(ValueError, match="drift_after_requests"):
        DriftingMiniLM(drift_after_requests=-1)


def test_the_drifting_minilm_counts_reads_and_keeps_the_encoders_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from worker.models.minilm import MiniLMModel

    plain, drifting = MiniLMModel(), DriftingMiniLM(drift_after_requests=2, drift_factor=1.5)
    for model in (plain, drifting):
        model.load(torch.device("cpu"))
    texts = [{"text": "the capital of France"}, {"text": "is Paris"}]
    items = [drifting.prepare(t, 0) for t in texts[:1]]
    assert not drifting.drifted
    items += [drifting.prepare(t, 0) for t in texts[1:]]
    assert drifting.drifted and drifting.read == 2
    slept: list[float] = []
    monkeypatch.setattr("bench.latency.live.drifting.time.sleep", slept.append)
    with torch.inference_mode():
        got = drifting.forward(drifting.collate(items))
        want = plain.forward(plain.collate([plain.prepare(t, 0) for t in texts]))
    assert torch.allclose(got, want, atol=1e-5)
    assert len(slept) == 1 and slept[0] > 0  # the drifted forward slept its extra half


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


def test_g3_counts_the_refusals_within_its_bar() -> None:
    refused = [Sample(i, ms, ms, {"ok": False}) for i, ms in enumerate([1.0, 4.9, 5.0, 6.5])]
    stats = refusals(refused, target_ms=100)
    assert stats["refused"] == 4 and stats["refusal_max_ms"] == 6.5
    assert stats["refused_within_bar"] == 0.75  # 5 ms = 0.05 x 100 is within; 6.5 is not
    assert refusals([], target_ms=100)["refused_within_bar"] is None


def run_benchmark(tmp_path: Path, *args: str) -> dict[str, Any]:
    """`python -m bench.latency.live` with 2 s phases in a subprocess; its JSON."""
    out = tmp_path / "goals.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.latency.live", "--phase-s", "2", "--paced-warmup",
         "--reply-timeout-s", "10", "--out", str(out), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    return results


@pytest.mark.slow
def test_g2_g4_g5_run_on_real_processes(tmp_path: Path) -> None:
    results = run_benchmark(tmp_path, "--capacity", "200", "--goals", "G2,G4,G5",
                            "--only", "static wait 0 batch 32")
    name = "static wait 0 batch 32"
    assert results["G2 light load"][name]["p50_ms"] > 0
    # Both phases were timed; how much slower the second is depends on the host and on the
    # batches, so it is the benchmark's figure, not a test's (the drift is unit-tested above).
    assert all(ms > 0 for ms in results["G4 drift"][name]["compute_ms_per_phase"])
    buckets = results["G5 mixed lengths"][name]["buckets"]
    assert set(buckets) == {"0", "1"} and all(b["served"] == b["sent"] > 0
                                              for b in buckets.values())
    markdown = render(results)
    assert "G2 light load" in markdown and "G4 drift" in markdown and "b1:" in markdown


def test_minilm_requests_have_exactly_their_token_length() -> None:
    import msgpack
    import torch

    from bench.latency.live.goals import text_payload
    from worker.models.minilm import MiniLMModel

    model = MiniLMModel()
    model.load(torch.device("cpu"))
    for tokens in (8, 16, 96, 128):
        payload = text_payload(tokens)
        assert model.prepare(msgpack.unpackb(payload), len(payload)).length == tokens


@pytest.mark.slow
def test_g4_runs_on_the_real_minilm_encoder(tmp_path: Path) -> None:
    results = run_benchmark(tmp_path, "--model", "minilm", "--capacity", "20", "--goals", "G4",
                            "--only", "redbatch", "--sample-metrics")
    row = results["G4 drift"]["redbatch"]
    assert all(ms > 0 for ms in row["compute_ms_per_phase"]) and row["unanswered"] == 0
    window = row["dispatch"][0]  # the worker's decisions, sampled from its /metrics
    assert sum(window["reasons"].values()) > 0 and window["per_batch"] >= 1
    assert 0 < window["busy"] < 1.5
    markdown = render(results)
    assert "MiniLM's batch times x1.5" in markdown and "--sample-metrics" in markdown


def test_the_sweep_for_c_takes_its_shares_from_the_command_line() -> None:
    from bench.latency.live.run import SHARES, parser

    assert parser().parse_args([]).shares == SHARES
    assert parser().parse_args(["--shares", "0.62,0.64"]).shares == (0.62, 0.64)
    for bad in ("0.6,x", "0,0.5", "2"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--shares", bad])


def test_instances_apply_to_every_configuration_and_default_to_the_devices() -> None:
    from bench.latency.live.run import chosen_device, parser

    assert chosen_device(parser().parse_args(["--model", "minilm"])).base["instances"] == "auto"
    assert chosen_device(parser().parse_args([])).base["instances"] == 2
    two = chosen_device(parser().parse_args(["--model", "minilm", "--instances", "2"]))
    assert two.base["instances"] == 2 and two.base["torch_threads"] == 1
    assert all(settings["instances"] == 2 for settings in configs(250.0, False, two.base).values())


def test_instances_below_one_are_refused_with_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    from bench.latency.live.run import parser

    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--instances", bad])
        assert "--instances" in capsys.readouterr().err


def test_a_capacity_of_zero_or_less_is_refused_with_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    from bench.latency.live.run import parser

    for bad in ("0", "-3", "fast"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--capacity", bad])
        assert "--capacity" in capsys.readouterr().err


def test_a_sweep_that_holds_no_share_runs_no_goal(tmp_path: Path, monkeypatch,  # type: ignore[no-untyped-def]
                                                  capsys) -> None:
    """Every goal's load is a share of C, so with C = 0 the benchmark says so and stops,
    with the sweep in its JSON, instead of sending nothing to every configuration."""
    import bench.latency.live.run as latency_bench

    sweep = {"saturated_per_s": 193.6, "shares_held": {},
             "worst_window_p99_ms": {"static wait 0 batch 32": {"0.8": 412.0}}}
    monkeypatch.setattr(latency_bench, "capacity", lambda *args: (0.0, sweep))
    out = tmp_path / "sweep.json"
    assert latency_bench.main(["--model", "minilm", "--out", str(out)]) == 1
    assert "no share of the saturated rate held p99 <= 250 ms" in capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["capacity_sweep"] == sweep and "G1 step load" not in results


def test_rounds_give_each_configuration_its_median_and_g2_reads_the_median_ratio() -> None:
    from bench.latency.live.report import round_rows

    def rows(redbatch: float, static: float) -> dict[str, Any]:
        return {"redbatch": {"p50_ms": redbatch, "p99_ms": 2 * redbatch},
                "static wait 0 batch 32": {"p50_ms": static, "p99_ms": 2 * static}}

    results = {"G2 light load": rows(12.0, 10.0),  # 1.2 x in one round, 1.0 x in two
               "later_rounds": {"G2 light load": [rows(10.0, 10.0), rows(20.0, 20.0)]}}
    table = "\n".join(round_rows(results))
    assert "G2 light load, 3 rounds in turn" in table
    assert "| redbatch | 12 / 10 / 20 | 24 / 20 / 40 | 12 / 24 | 1.200 / 1.000 / 1.000 | " \
           "1.000, met |" in table
    without = {"G1 step load": {"aimd": {"p50_ms": 5.0, "p99_ms": 9.0}},
               "later_rounds": {"G1 step load": [{"aimd": {"p50_ms": 7.0, "p99_ms": 11.0}}]}}
    assert "| aimd | 5 / 7 | 9 / 11 | 6 / 10 | n/a | n/a |" in "\n".join(round_rows(without))


@pytest.mark.slow
def test_rounds_run_each_configuration_again_on_real_processes(tmp_path: Path) -> None:
    results = run_benchmark(tmp_path, "--capacity", "200", "--goals", "G2", "--rounds", "2",
                            "--only", "static wait 0 batch 32")
    name = "static wait 0 batch 32"
    assert results["rounds_per_goal"] == 2
    [second] = results["later_rounds"]["G2 light load"]
    assert second[name]["p50_ms"] > 0 and second[name]["unanswered"] == 0
    assert "| 1.000 / 1.000 | 1.000, met |" in render(results)
