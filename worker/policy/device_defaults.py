"""Defaults that suit the device: batch limits and buckets for a GPU; a CPU's stay as set.

A GPU is fed by batches far larger than a CPU's: sentence-transformers' `encode` of MiniLM
on an H200 ran 9,456 texts/s at batch 512 against 6,198 at 128 (issue 31), so on CUDA a
batch may hold 512 requests and 65,536 padded tokens (512 texts of a 128-token bucket, or
256 of the longest, 256-token one), and 4,096 requests may be in flight: enough to fill a
batch in each of two instances while the next two fill. Its buckets are the model's own,
thinned to steps of at least 1.5x: padding costs a GPU little next to a smaller batch, and
each bucket is a set of CUDA graphs to capture. These figures come from that one
measurement and are re-measured by `python -m bench.gpu_check`. Batch jobs' lines may take
a quarter of a GPU's time beside online calls, not a CPU's 0.1, and four rows of a batch,
not two: on a CPU the gateway and Redis share the cores with the worker, so busy cores slow
the online calls' whole path (policy/background.py), while a GPU's time is the worker's
alone (not yet measured on one).
Pure: a device type in, settings out; a setting the user set is never replaced.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, Self, TypeVar


class Configured(Protocol):
    """Settings as this needs them (worker/settings.py's pydantic model): which fields the
    user set, and a copy with some changed."""

    @property
    def model_fields_set(self) -> set[str]: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Self: ...


SettingsT = TypeVar("SettingsT", bound=Configured)

CUDA_BATCH_DEFAULTS: Mapping[str, float] = {
    "max_batch_size": 512,  # sentence-transformers' best batch on an H200 (issue 31)
    "max_batch_tokens": 65_536,  # 512 x 128 tokens: the batch above at a common length
    "max_inflight": 4_096,  # 2 instances x (a batch computing + one filling) x 512, doubled
    "background_share": 0.25,  # batch jobs' lines beside online calls (see above)
    "background_rows": 4,  # batch lines in a batch beside online ones (see above)
}
# Handed to a child process only when set: it resolves them for its own device (and says
# why graphs are skipped only if they were asked for).
UNSET_STAYS_UNSET = frozenset({*CUDA_BATCH_DEFAULTS, "cuda_graphs"})
CUDA_BUCKET_STEP = 1.5  # each kept boundary at least this far above the one before


def device_defaults(device_type: str, set_fields: Collection[str]) -> dict[str, Any]:
    """The settings `device_type` changes from the CPU's defaults, left out when set."""
    if device_type != "cuda":
        return {}
    return {name: value for name, value in CUDA_BATCH_DEFAULTS.items()
            if name not in set_fields}


def on_device(settings: SettingsT, device_type: str) -> SettingsT:
    """`settings` with the device's defaults for what the user did not set (a CPU's: the
    settings unchanged); applying it twice changes nothing more."""
    changes = device_defaults(device_type, settings.model_fields_set)
    return settings.model_copy(update=changes) if changes else settings


def default_boundaries(model_boundaries: Sequence[int], device_type: str) -> list[int]:
    """The buckets when the settings give none: the model's own on a CPU, thinned on CUDA."""
    if device_type != "cuda":
        return list(model_boundaries)
    return thinned(model_boundaries, CUDA_BUCKET_STEP)


def thinned(boundaries: Sequence[int], step: float) -> list[int]:
    """The first boundary, then each one at least `step` times the last kept, and the last
    one always (inputs longer than it still have their own open-ended bucket)."""
    kept: list[int] = []
    for boundary in boundaries:
        if not kept or boundary >= kept[-1] * step:
            kept.append(boundary)
    if boundaries and kept[-1] != boundaries[-1]:
        kept.append(boundaries[-1])
    return kept
