"""The latency-target goals on the simulator (bench/latency/sim/simulate.py): the real Batcher and
policy on a simulated clock, seeded. Each runs minutes of traffic in seconds."""

from __future__ import annotations

import pytest

from bench.latency.sim.goals import MINILM, Scenario, capacity
from bench.latency.sim.report import drift, light_load, overload, step_load

PHASE_S = 30.0
SEED = 7


@pytest.fixture(scope="module")
def c() -> float:
    return capacity(MINILM, SEED)


def test_the_capacity_is_found_by_the_static_sweep(c: float) -> None:
    # two instances of 10 ms + 0.21 ms per padded token, a mix of ~12 and ~112 tokens
    assert 100 < c < 250


def test_g1_a_load_step_holds_the_target_with_the_goodput_of_the_best_static(c: float) -> None:
    row = step_load(MINILM, c, PHASE_S, SEED)["redbatch"]
    assert row["met"], row
    assert row["goodput_vs_best_static"] >= 0.95


def test_g2_light_load_costs_nothing(c: float) -> None:
    row = light_load(MINILM, c, PHASE_S, SEED)["redbatch"]
    assert row["met"], row


def test_g3_overload_is_shed_at_once_and_the_admitted_hold_the_target(c: float) -> None:
    rows = overload(MINILM, c, PHASE_S, SEED)
    assert rows["redbatch"]["met"], rows["redbatch"]
    # the negative control: without shedding, a static queue collapses
    assert rows["aimd"]["goodput_vs_c"] < 0.5


def test_g4_a_slower_device_is_followed_within_three_windows(c: float) -> None:
    row = drift(MINILM, c, PHASE_S, SEED)["redbatch"]
    assert row["met"], row


def test_an_unreachable_target_is_missed_honestly() -> None:
    """The check can fail: a target below one batch's service time cannot be held."""
    impossible = Scenario("impossible", MINILM.cost, MINILM.lengths, MINILM.boundaries,
                          target_ms=5.0, instances=2)
    row = step_load(impossible, 100.0, 10.0, SEED)["redbatch"]
    assert not row["met"]
