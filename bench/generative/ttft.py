"""Time to first token, unloaded and under load, on the same prompts.

Each request's TTFT under load is set beside its own unloaded TTFT (the same prompt sent
alone with max_new_tokens 1): a long prompt takes longer to prefill whatever the load, so a
loaded p95 set against the unloaded p50 of a few short prompts mixes the prompt mix into
the figure. Reported: p50 and p95 of each, the old ratio (loaded p95 / unloaded p50), the
like-for-like one (loaded p95 / unloaded p95), and the p50 and p95 of the per-request
slowdown (loaded / alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.common.stats import median, percentile
from bench.generative.online import ttft_loaded, ttft_unloaded
from bench.generative.workload import GenRequest

LOADS = (0.5, 0.8)


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {"p50": median(values), "p95": percentile(values, 95), "values": list(values)}


def compare(loaded: Sequence[float], alone: Sequence[float]) -> dict[str, Any]:
    """`loaded[i]` and `alone[i]` are the same request's TTFT."""
    slowdown = [a / b for a, b in zip(loaded, alone, strict=True)]
    row = summary(loaded)
    row.update(p95_over_unloaded_p50=row["p95"] / median(alone),
               p95_over_unloaded_p95=row["p95"] / percentile(alone, 95),
               slowdown_p50=median(slowdown), slowdown_p95=percentile(slowdown, 95))
    return row


def time_to_first_token(url: str, stream: str, requests: Sequence[GenRequest],
                        saturated_rps: float, seed: int) -> dict[str, Any]:
    """Every request alone first (its unloaded TTFT), then all of them at 50 % and 80 % of
    the saturated request rate, as Poisson arrivals."""
    first_only = [replace(r, payload={**r.payload, "max_new_tokens": 1}) for r in requests]
    alone = ttft_unloaded(url, stream, first_only)
    result: dict[str, Any] = {"unloaded": summary(alone)}
    for load in LOADS:
        loaded = ttft_loaded(url, stream, requests, load * saturated_rps, seed)
        result[f"{load:.0%}"] = {"rate_rps": load * saturated_rps, **compare(loaded, alone)}
    return result
