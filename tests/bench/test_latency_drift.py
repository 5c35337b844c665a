"""bench.latency.sim.drift: G4 over seeds on a chosen device (the simulator: seeded, no clock)."""

from __future__ import annotations

import pytest

from bench.latency.sim.drift import main, policies, scenario, sweep

SEEDS = [1, 2]


def test_every_policy_runs_on_the_same_seeds() -> None:
    s = scenario(10.0, 0.21, 2, 250.0)
    result = sweep(s, 0.5, SEEDS, 40.0)
    assert result["capacity_per_s"] > 0
    assert set(result["rows"]) == set(policies(s))
    assert "static wait 0 batch 32" in result["rows"] and "redbatch" in result["rows"]
    for row in result["rows"].values():
        assert 0 <= row["met"] <= len(SEEDS) and row["windows_over"] >= 0


def test_a_light_load_is_held_by_every_static_and_an_overload_by_none() -> None:
    """The figure tells a load that can be held from one that cannot."""
    s = scenario(12.0, 0.2, 1, 250.0)
    light = sweep(s, 0.2, SEEDS, 40.0)["rows"]
    heavy = sweep(s, 1.2, SEEDS, 40.0)["rows"]
    statics = [name for name in light if name.startswith("static")]
    assert all(light[name]["met"] == len(SEEDS) for name in statics)
    assert all(row["met"] == 0 for row in heavy.values())


def test_a_phase_too_short_for_the_goal_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 40 s"):
        sweep(scenario(10.0, 0.21, 2, 250.0), 0.5, SEEDS, 30.0)


def test_the_table_names_the_device_and_every_policy(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--seeds", "1", "--phase-s", "40", "--instances", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 instance(s)" in out and "| redbatch |" in out and "| bentoml_cork |" in out


def test_no_seeds_or_instances_are_refused_on_the_command_line() -> None:
    for bad in (["--seeds", "0"], ["--instances", "0"]):
        with pytest.raises(SystemExit):
            main(bad)
