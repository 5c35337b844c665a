"""The peers report's goals (pure): a peer's fastest configuration, and where that one is
below redbatch's accuracy bound, its fastest one above it as well; and the accuracy compare
of a system whose encode returns a rate (redbatch's) through its `embed`."""

from __future__ import annotations

from typing import Any

import numpy
import pytest

from bench.peers.report import goals
from bench.peers.systems import System, compare


def row(name: str, peer: str, rate: float, over: float, cosine: float | None) -> dict[str, Any]:
    return {"name": name, "peer": peer, "dtype": "x", "config": "batch 32",
            "texts_per_s": rate, "redbatch_over": over, "min_cosine": cosine}


def test_a_peer_fast_but_inaccurate_is_also_compared_at_its_best_accurate_setting() -> None:
    rows = [row("redbatch", "redbatch", 700, 1.0, None),
            row("redbatch offline", "redbatch", 750, 0.94, None),
            row("onnxruntime fp32", "onnxruntime", 350, 2.0, 1.0),
            row("onnxruntime int8", "onnxruntime", 700, 1.05, 0.93),
            row("st bfloat16", "st", 460, 1.6, 0.9995)]
    found = {g["goal"].split(" (")[0]: (g["value"], g["met"]) for g in goals(rows)}
    assert found == {
        "redbatch >= 1.5x onnxruntime at its best": (1.05, False),
        "redbatch >= 1.5x onnxruntime at its best with min cosine >= 0.999": (2.0, True),
        "redbatch >= 1.5x st at its best": (1.6, True),  # accurate already: one goal
        "redbatch >= 0.9x its offline limit": (0.94, True)}


def test_a_system_that_returns_rates_is_compared_through_its_embed() -> None:
    """redbatch's encode returns its texts/s; its `embed` gives the rows compared."""
    reference = System("st fp32", "st", "float32", {"batch 32": lambda texts: numpy.eye(2)},
                       chosen="batch 32")
    tilted = numpy.array([[0.6, 0.8], [0.0, 1.0]])
    ours = System("redbatch offline", "redbatch", "bfloat16", {"batch 32": lambda texts: 1.0},
                  chosen="batch 32", embed=lambda texts: tilted)
    compare([ours, reference], reference, ["a", "b"])
    assert ours.min_cosine == pytest.approx(0.6) and reference.min_cosine == 1.0
