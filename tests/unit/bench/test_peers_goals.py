"""The peers report's goals (pure): a peer's fastest configuration, and where that one is
below redbatch's accuracy bound, its fastest one above it as well."""

from __future__ import annotations

from typing import Any

from bench.peers.report import goals


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
