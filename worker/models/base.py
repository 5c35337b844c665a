"""The model interface: what a plugin must provide for the worker to batch and run it.

A model turns one decoded payload into a `Prepared` item (validating it and measuring its
length; `prepare_many` does a read's payloads in one call), collates a list of items into
one padded batch, runs the batch, and splits the output back into one JSON/msgpack-
serialisable result per item. The worker owns everything else: reading, bucketing,
devices, replies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from producer.liveness import Kind


class InvalidInput(ValueError):
    """The payload is not a valid input for this model; answered as `invalid_request`.

    `field` names the payload key at fault and `reason` a kind of mistake a client may act
    on (`context_window`); both go into the error envelope, so a client (the gateway) need
    not parse the message."""

    def __init__(self, message: str, field: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.details = {key: value for key, value in (("field", field), ("reason", reason))
                        if value is not None}


@dataclass(slots=True)
class Prepared:
    """One request after preprocessing: its length (tokens, bytes...) and the model's data."""

    length: int
    data: Any


class Model(ABC):
    """Subclass this and name it in settings as `model = "package.module:ClassName"`.

    The constructor receives the `model_options` table as keyword arguments. With
    `instances` above 1, collate, forward and postprocess run on several threads at once
    (one per instance) on this one object: keep per-batch state out of `self`.
    """

    #: bucket boundaries used when the settings give none
    default_bucket_boundaries: Sequence[int] = (16, 32, 64, 128, 256)
    #: collate, forward and postprocess may run on several threads at once (no per-batch
    #: state in `self`): `instances = "auto"` then runs one instance per CPU core
    concurrent_forward: bool = False
    #: a generative model (models/generative.py): served token by token by the generate
    #: loop (pipeline/generate.py), not by collate/forward/postprocess
    generative: bool = False
    #: forward may be captured as a CUDA graph per shape (execution/cuda_graphs.py): its
    #: batch is a dict of (rows, length) tensors padded with zeros, its output one tensor
    #: with a row per input row, and it never waits for the device (no .item(), no branch
    #: on a tensor's values)
    graph_capturable: bool = False
    #: what the model serves, announced to the gateway and the clients, which route and
    #: refuse by it (liveness.Kind); a generative model is always Kind.GENERATIVE
    kind: Kind = Kind.EMBEDDING
    #: the dtype to compute in (the `dtype` setting, resolved for the device), set by the
    #: worker before load(); a model that has only one may ignore it
    dtype: torch.dtype = torch.float32
    #: why that dtype (policy/precision.py), for `worker.serving`, `stats` and the hash
    dtype_reason: str = "the model's default"
    #: `int8` (dynamic int8 linear layers, models/quantize.py; dtype stays float32) where
    #: the `dtype` setting asks for it, set by the worker before load(); only a model with
    #: `int8_capable` is given it
    quantization: str | None = None
    int8_capable: bool = False
    #: where the model may keep what it derives from its weights between starts (a GGUF
    #: file's dequantised tensors), set by the worker before load(); None: keep nothing
    cache_dir: Path | None = None
    #: where load() put it
    device: torch.device

    @property
    def precision_name(self) -> str:
        """What it computes in, as the settings, logs and calibration files name it."""
        return self.quantization or str(self.dtype).removeprefix("torch.")

    @abstractmethod
    def load(self, device: torch.device) -> None:
        """Load weights onto `device`, in `self.dtype`. Called once, before any other method."""

    @abstractmethod
    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        """Validate and preprocess one decoded payload (`nbytes`: its encoded size).

        Raise InvalidInput for a user mistake. Runs on the reader thread, overlapping the
        compute of the current batch, so tokenisation belongs here.
        """

    def prepare_many(self, payloads: Sequence[tuple[Any, int]]) -> list[Prepared | Exception]:
        """`prepare` for each (payload, nbytes) of one read, in order: an item, or the
        exception that refuses that one payload (InvalidInput: a user mistake).

        Override it to preprocess a read's payloads in one call (a batch tokeniser runs
        outside the GIL); one bad payload must not affect the others."""
        prepared: list[Prepared | Exception] = []
        for payload, nbytes in payloads:
            try:
                prepared.append(self.prepare(payload, nbytes))
            except Exception as exc:  # answered for this payload alone, by the intake
                prepared.append(exc)
        return prepared

    @abstractmethod
    def collate(self, items: Sequence[Prepared]) -> Any:
        """Build one batch, padded to its longest member. Tensors stay on the host here."""

    @abstractmethod
    def forward(self, batch: Any) -> Any:
        """Run the batch (already on the device); called under torch.inference_mode()."""

    @abstractmethod
    def postprocess(self, output: Any, items: Sequence[Prepared]) -> list[Any]:
        """One serialisable result per item, in order (on CUDA, `output` is already on the host)."""

    def announced_kind(self) -> Kind:
        """The kind the worker announces: the generate loop serves only generative models."""
        return Kind.GENERATIVE if self.generative else self.kind

    def answers_on_stream(self, payload: Any) -> bool:
        """A generative model: whether an error about this payload (None: undecodable) goes
        to the request's reply stream rather than its list reply key."""
        return False

    def sample(self, length: int) -> Prepared | None:
        """A synthetic input of about `length` for warm-up and calibration; None: no warm-up."""
        return None
