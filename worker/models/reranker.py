"""`reranker`: a cross-encoder scoring how well a text answers a query, from a local directory.

`model_options`: `path` (a Hugging Face sequence-classification model with one label, as
sentence-transformers' CrossEncoder saves it: bge-reranker, ms-marco-MiniLM...), and
optionally `max_seq_length` (default: the model's limit, encoder_dir.model_limit) and `trace`
(run it as a TorchScript trace, tracing.py; default: on a CPU).

One request is one (query, text) pair: `{"query": <string>, "text": <string>}` answers
`{"score", "logit", "tokens"}`. The pair is tokenised together (truncated longest first, as
Hugging Face does), so its length picks the bucket as a text's does for embeddings; the
gateway's /v1/rerank sends one request per document. `score` is the logit through the
model's activation: the sigmoid, as CrossEncoder does for one label, unless the directory's
config names Identity; `logit` is the raw output (TEI's `raw_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from producer.liveness import Kind
from worker.models.ascii_tokenizer import reachable
from worker.models.base import InvalidInput, Model, Prepared
from worker.models.encoder import FILLER_TEXT, TRACE_SHAPES, load_tokenizer
from worker.models.encoder_dir import EncoderDirError, model_limit, read_json
from worker.models.quantize import INT8, quantized_int8
from worker.models.tracing import traced_or_none

BATCH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # CrossEncoderLogits' order
PAIR_MESSAGE = 'payload must be an object {"query": <string>, "text": <string>}'


@dataclass(slots=True)
class Pair:
    """A tokenised (query, text) pair: its ids and their segment (token type) ids."""

    ids: list[int]
    types: list[int]


class CrossEncoderLogits(torch.nn.Module):
    """The classifier's one logit per pair, in float32: a module of tensors alone, to trace."""

    def __init__(self, classifier: torch.nn.Module, token_types: bool) -> None:
        super().__init__()
        self.classifier = classifier
        self.token_types = token_types  # RoBERTa-likes have one token type, DistilBERT none

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.token_types else {}
        logits = self.classifier(input_ids=input_ids, attention_mask=attention_mask,
                                 **extra).logits
        return logits[:, 0].float()


class RerankerModel(Model):
    kind = Kind.RERANKER
    default_bucket_boundaries: Sequence[int] = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    concurrent_forward = True  # shared read-only weights; per-batch state stays local
    int8_capable = True  # its linear layers quantize (models/quantize.py)

    def __init__(self, path: str | None = None, max_seq_length: int | None = None,
                 trace: bool | None = None) -> None:
        if trace not in (None, True, False):
            raise ValueError(f"trace must be true, false or null (on a CPU); got {trace!r}")
        self.trace = trace
        if not path:
            raise ValueError("the reranker model needs a `path` to a local model directory")
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise ValueError(f"no model directory (config.json) at {self.path}")
        config = read_json(self.path / "config.json")
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
        if labels != 1:
            raise ValueError(f"a reranker has one output label; {self.path} has {labels}")
        if max_seq_length is not None and (not isinstance(max_seq_length, int)
                                           or max_seq_length < 3):
            raise ValueError(f"max_seq_length must be an integer >= 3; got {max_seq_length!r}")
        try:
            self.max_seq_length = max_seq_length or model_limit(self.path)
        except EncoderDirError as exc:
            raise ValueError(str(exc)) from None
        self.sigmoid = activation_of(config) != "Identity"

    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = load_tokenizer(self.path, self.max_seq_length)
        self.device = device
        classifier = AutoModelForSequenceClassification.from_pretrained(self.path).eval()
        classifier.to(device, self.dtype)
        if self.quantization == INT8:
            classifier = quantized_int8(classifier)
        token_types = getattr(classifier.config, "type_vocab_size", 0) > 1
        self.scorer: torch.nn.Module = CrossEncoderLogits(classifier, token_types)
        if self.trace or (self.trace is None and device.type == "cpu"):
            example, *checks = [self._inputs([self.sample(length) for length in lengths])
                                for lengths in TRACE_SHAPES]
            self.scorer = traced_or_none(self.scorer, example, checks, atol=1e-4) or self.scorer

    def _inputs(self, items: Sequence[Prepared]) -> tuple[torch.Tensor, ...]:
        batch = self.collate(items)
        return tuple(batch[name].to(self.device) for name in BATCH_INPUTS)

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        [prepared] = self.prepare_many([(payload, nbytes)])
        if isinstance(prepared, Exception):
            raise prepared
        return prepared

    def prepare_many(self, payloads: Sequence[tuple[Any, int]]) -> list[Prepared | Exception]:
        """One batch call of the Rust tokenizer for a read's pairs (outside the GIL)."""
        prepared: list[Prepared | Exception] = []
        pairs: list[tuple[str, str]] = []
        cut = reachable(self.tokenizer)  # what truncation could keep of each text
        for payload, _ in payloads:
            try:
                query, text = pair_of(payload)
                pairs.append((query[cut], text[cut]))
            except InvalidInput as exc:
                prepared.append(exc)
                continue
            prepared.append(Prepared(0, Pair([], [])))
        encodings = iter(self.tokenizer.encode_batch_fast(pairs) if pairs else ())
        for item in prepared:
            if isinstance(item, Prepared):
                encoding = next(encodings)
                item.data = Pair(encoding.ids, encoding.type_ids)
                item.length = len(encoding.ids)
        return prepared

    def sample(self, length: int) -> Prepared:
        """A pair of filler words of about `length` tokens, for warm-up and calibration."""
        specials = len(self.tokenizer.encode("", "").ids)
        words = max(2, min(length, self.max_seq_length) - specials)
        encoding = self.tokenizer.encode(f"{FILLER_TEXT} " * (words - words // 2),
                                         f"{FILLER_TEXT} " * (words // 2))
        return Prepared(len(encoding.ids), Pair(encoding.ids, encoding.type_ids))

    def collate(self, items: Sequence[Prepared]) -> dict[str, torch.Tensor]:
        """One right-padded batch, placed by a mask of the real positions (as encoder.py)."""
        lengths = np.fromiter((item.length for item in items), np.int64, len(items))
        real = np.arange(lengths.max()) < lengths[:, None]
        batch = {"attention_mask": torch.from_numpy(real.astype(np.int64))}
        for name, field in (("input_ids", "ids"), ("token_type_ids", "types")):
            flat = np.fromiter(chain.from_iterable(getattr(item.data, field) for item in items),
                               np.int64, int(lengths.sum()))
            padded = np.zeros(real.shape, np.int64)
            padded[real] = flat
            batch[name] = torch.from_numpy(padded)
        return batch

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits: torch.Tensor = self.scorer(*(batch[name] for name in BATCH_INPUTS))
        return logits

    def postprocess(self, output: torch.Tensor, items: Sequence[Prepared]) -> list[Any]:
        logits = output.float()
        scores = torch.sigmoid(logits) if self.sigmoid else logits
        return [{"score": score, "logit": logit, "tokens": item.length} for score, logit, item
                in zip(scores.tolist(), logits.tolist(), items, strict=True)]


def activation_of(config: dict[str, Any]) -> str:
    """The activation a sentence-transformers CrossEncoder saved in config.json (its class
    name); empty when none: then the sigmoid, CrossEncoder's default for one label."""
    said = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function") or ""
    return str(said).rsplit(".", 1)[-1]


def pair_of(payload: Any) -> tuple[str, str]:
    """The payload's (query, text)."""
    if not isinstance(payload, dict):
        raise InvalidInput(PAIR_MESSAGE)
    for field in ("query", "text"):
        if not isinstance(payload.get(field), str):
            raise InvalidInput(PAIR_MESSAGE, field=field)
    return payload["query"], payload["text"]
