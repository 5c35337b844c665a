"""The echo model's cost model: each figure pins the formula (fixed + per request + per
padded token, times the drift once it is due), so a change to it fails here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from producer import Client
from worker.models import ModelLoadError, create_model
from worker.models.echo import EchoBatch, EchoCost, EchoModel


def loaded(**options: Any) -> EchoModel:
    model = EchoModel(**options)
    model.load(torch.device("cpu"))
    return model


def collated(model: EchoModel, lengths: list[int]) -> EchoBatch:
    batch = model.collate([model.prepare(f"p{n}", n) for n in lengths])
    assert isinstance(batch, EchoBatch)
    return batch


def test_the_cost_is_fixed_plus_per_request_plus_per_padded_token() -> None:
    cost = EchoCost(delay_ms=10, per_item_ms=1, per_token_ms=0.5, drift_factor=1.5)
    assert cost.mean_ms(3, 7, drifted=False) == 10 + 3 * 1 + 0.5 * 3 * 7  # 23.5
    assert cost.mean_ms(3, 7, drifted=True) == pytest.approx(1.5 * 23.5)
    assert EchoCost(per_token_ms=0.02).mean_ms(32, 128, drifted=False) == pytest.approx(81.92)


def test_a_batch_is_padded_to_its_longest_payload() -> None:
    model = loaded(delay_ms=2, per_token_ms=0.1)
    batch = collated(model, [10, 120, 40])
    assert batch == ["p10", "p120", "p40"] and batch.longest == 120
    assert model.cost_s(len(batch), batch.longest) == pytest.approx((2 + 0.1 * 3 * 120) / 1000)
    assert model.postprocess(model.forward(batch), []) == ["p10", "p120", "p40"]


def test_short_and_long_batches_cost_differently() -> None:
    model = loaded(delay_ms=10, per_token_ms=0.02)
    short, long = collated(model, [16] * 32), collated(model, [128] * 32)
    assert model.cost_s(32, short.longest) == pytest.approx(0.01024 + 0.01)
    assert model.cost_s(32, long.longest) == pytest.approx(0.08192 + 0.01)


def test_forward_sleeps_the_modelled_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded(delay_ms=5, per_item_ms=1, per_token_ms=0.1)
    batch = collated(model, [50, 100])  # 5 + 2 + 0.1 * 2 * 100 = 27 ms
    slept: list[float] = []
    monkeypatch.setattr("worker.models.echo.time.sleep", slept.append)
    model.forward(batch)
    assert slept == [pytest.approx(0.027)]


def test_the_drift_starts_once_that_many_requests_were_read() -> None:
    model = loaded(delay_ms=10, per_item_ms=2, drift_after_requests=3, drift_factor=1.5)
    collated(model, [1, 1])
    assert model.cost_s(2) == pytest.approx(0.014)  # 2 read: not yet
    model.sample(64)  # the warm-up's samples are not requests read
    assert model.cost_s(2) == pytest.approx(0.014)
    collated(model, [1])
    assert model.cost_s(2) == pytest.approx(0.021)  # the 3rd read: x1.5 from now on
    assert loaded(delay_ms=10, drift_factor=1.5).cost_s(1) == pytest.approx(0.010)  # no count


def test_jitter_is_seeded_noise_around_the_cost() -> None:
    one, two = loaded(delay_ms=10, jitter_ms=2, seed=7), loaded(delay_ms=10, jitter_ms=2, seed=7)
    draws = [one.cost_s(1) for _ in range(200)]
    assert draws == [two.cost_s(1) for _ in range(200)]
    assert sum(draws) / len(draws) == pytest.approx(0.010, abs=0.0005) and len(set(draws)) > 1


@pytest.mark.parametrize("options, named", [
    ({"per_token_ms": -0.1}, "per_token_ms"), ({"drift_factor": 0}, "drift_factor"),
    ({"drift_after_requests": -1}, "drift_after_requests"),
    ({"drift_after_requests": 2.5}, "drift_after_requests"),
    ({"delay_ms": -1}, "delay_ms")])
def test_bad_cost_options_are_refused_by_name(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        create_model("echo", options)


def test_the_drift_shows_in_the_batches_computed_through_redis(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    """One request at a time: 20 ms before the 4th request read, 30 ms from it on. What the
    model asked of the device is checked exactly; the clock only from below (a sleep never
    returns early, but a busy host may wake it late)."""
    model = loaded(delay_ms=20, drift_after_requests=4, drift_factor=1.5)
    asked: list[float] = []
    modelled = model.cost_s

    def recorded(size: int, longest: int = 0) -> float:
        asked.append(modelled(size, longest))
        return asked[-1]

    model.cost_s = recorded  # type: ignore[method-assign]
    client = Client(redis_url, "echo")
    with worker_factory(instance=model, max_wait_ms=0, instances=1):
        computed = [client.wait(client.submit({"n": i}))["meta"]["compute_ms"]
                    for i in range(6)]
    assert asked[-6:] == pytest.approx([0.020] * 3 + [0.030] * 3), asked
    assert all(ms >= 19.5 for ms in computed[:3]) and all(ms >= 29.5 for ms in computed[3:])
