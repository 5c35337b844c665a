"""A module run as a TorchScript trace, kept only when it gives eager's results.

A trace runs a model's ~200 operators without a Python step between them and without the
GIL, so that model instances on other threads, the reader and the replier run alongside (on
a CPU, measured there). It fixes the branches taken on its example, so it is checked on
shapes it was not traced with.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import structlog
import torch

log = structlog.get_logger("redbatch.tracing")


def traced_or_none(eager: torch.nn.Module, example: tuple[torch.Tensor, ...],
                   checks: Sequence[tuple[torch.Tensor, ...]],
                   atol: float = 1e-5) -> torch.nn.Module | None:
    """`eager` traced on `example`, if it matches eager on each of `checks`; else None."""
    with torch.inference_mode(), warnings.catch_warnings():
        # It warns of the branches it fixes; the checks below are what count.
        warnings.simplefilter("ignore")
        try:
            traced = torch.jit.trace(eager, example, check_trace=False)
            matches = all(torch.allclose(traced(*inputs), eager(*inputs), atol=atol)
                          for inputs in checks)
        except Exception as exc:
            log.warning("model.trace_failed", error=f"{type(exc).__name__}: {exc}")
            return None
    if not matches:
        log.warning("model.trace_differs", hint="running eager")
        return None
    return traced
