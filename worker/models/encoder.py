"""`encoder`: sentence embeddings from any local sentence-transformers or Hugging Face encoder.

`model_options`: `path` (the directory, required), and optionally `pooling`, `normalize`,
`max_seq_length` to override what the directory says (encoder_dir.py: 1_Pooling/config.json,
a Normalize module in modules.json, sentence_bert_config.json). Pipeline: truncate to
max_seq_length tokens, the encoder, pooling over the attention mask, optional L2
normalisation, as sentence-transformers computes it. MiniLM (minilm.py) is one instance.

On a CPU the encoder runs as a TorchScript trace (tracing.py), kept only if it gives eager's
results on shapes it was not traced with.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from producer.embeddings import ENCODINGS, FLOAT32, FLOAT_LIST, as_float32_bytes
from worker.models.ascii_tokenizer import BatchTokenizer
from worker.models.base import InvalidInput, Model, Prepared
from worker.models.encoder_dir import POOLINGS, EncoderDirError, EncoderLayout, read_layout
from worker.models.quantize import INT8, quantized_int8
from worker.models.tracing import traced_or_none

FILLER_TEXT = "this"  # any ordinary word piece costs the same to compute
TRACE_SHAPES = ((16, 9), (7,), (40, 5, 33))  # traced on the first batch, checked on the others


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per row of `hidden` (batch, tokens, dim), from the tokens `mask` keeps
    (right-padded rows), as sentence-transformers' Pooling module computes it."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "lasttoken":
        last = (mask.sum(dim=1) - 1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling == "max":
        return hidden.masked_fill(weights == 0, -1e9).max(dim=1).values
    counts = weights.sum(dim=1).clamp(min=1e-9)
    summed = (hidden * weights).sum(dim=1)
    return summed / (counts.sqrt() if pooling == "mean_sqrt_len_tokens" else counts)


class SentenceEncoder(torch.nn.Module):
    """The encoder, then pooling over the real tokens and optional L2 normalisation."""

    def __init__(self, bert: torch.nn.Module, pooling: str = "mean",
                 normalize: bool = True) -> None:
        super().__init__()
        self.bert = bert
        self.pooling = pooling
        self.normalize = normalize
        # DistilBERT and a few others take no token_type_ids
        self.token_types = "token_type_ids" in inspect.signature(bert.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": torch.zeros_like(attention_mask)} if self.token_types else {}
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                           **extra).last_hidden_state
        hidden = hidden.float()  # pooled and normalised in float32, whatever the dtype
        pooled = pool(hidden, attention_mask, self.pooling)
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled


class EncoderModel(Model):
    # ~1.25x steps: padding costs full compute on a CPU, and sentence lengths crowd the short end
    default_bucket_boundaries: Sequence[int] = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64,
                                                80, 96, 128, 160, 192, 256, 384, 512)
    concurrent_forward = True  # shared read-only weights; per-batch state stays local
    graph_capturable = True  # zero-padded ids and mask in, one embedding per row out
    int8_capable = True  # its linear layers quantize (models/quantize.py)

    def __init__(self, path: str | None = None, pooling: str | None = None,
                 normalize: bool | None = None, max_seq_length: int | None = None,
                 trace: bool | None = None) -> None:
        """`path`: the model directory; the others: None takes what the directory says.
        `trace`: run the encoder as a TorchScript trace; None: on a CPU (measured there)."""
        if trace not in (None, True, False):
            raise ValueError(f"trace must be true, false or null (on a CPU); got {trace!r}")
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}; got {pooling!r}")
        if normalize not in (None, True, False):
            raise ValueError(f"normalize must be true or false; got {normalize!r}")
        self.layout = self.read_layout(path, pooling, normalize, max_seq_length)
        self.path = self.layout.model_path
        self.max_seq_length = self.layout.max_seq_length
        self.trace = trace

    def read_layout(self, path: str | None, pooling: str | None, normalize: bool | None,
             max_seq_length: int | None) -> EncoderLayout:
        """The directory's layout, with the options given in place of what it says."""
        if not path:
            raise ValueError("the encoder model needs a `path` to a local model directory")
        try:
            found = read_layout(Path(path))
        except EncoderDirError as exc:
            raise ValueError(str(exc)) from None
        if max_seq_length is not None and (not isinstance(max_seq_length, int)
                                           or max_seq_length < 2):
            raise ValueError(f"max_seq_length must be an integer >= 2; got {max_seq_length!r}")
        return EncoderLayout(found.model_path, pooling or found.pooling,
                             found.normalize if normalize is None else normalize,
                             max_seq_length or found.max_seq_length)

    def load(self, device: torch.device) -> None:
        from transformers import AutoModel

        self.tokenizer = load_tokenizer(self.path, self.max_seq_length)
        self.batch_tokenizer = BatchTokenizer(self.tokenizer)  # ASCII skips the normalizer
        self.device = device
        self.model = AutoModel.from_pretrained(self.path).eval().to(device, self.dtype)
        if self.quantization == INT8:
            self.model = quantized_int8(self.model)
        self.encoder: torch.nn.Module = SentenceEncoder(self.model, self.layout.pooling,
                                                        self.layout.normalize)
        if self.trace or (self.trace is None and device.type == "cpu"):
            self.encoder = self._traced() or self.encoder

    def _traced(self) -> torch.nn.Module | None:
        """The encoder traced on one padded batch, if it matches eager on others."""
        example, *checks = [self._inputs([self.sample(length) for length in lengths])
                            for lengths in TRACE_SHAPES]
        return traced_or_none(self.encoder, example, checks)

    def _inputs(self, items: Sequence[Prepared]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.collate(items)
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        text, binary = sentence_of(payload)
        ids = self.tokenizer.encode(text[self.batch_tokenizer.reachable]).ids
        return Prepared(length=len(ids), data=Sentence(ids, binary))

    def prepare_many(self, payloads: Sequence[tuple[Any, int]]) -> list[Prepared | Exception]:
        """One batch call of the Rust tokenizer for a read's texts (two with ASCII ones:
        ascii_tokenizer.py): it runs outside the GIL (on its own threads), where one call
        per text paid the call overhead per text."""
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
        encodings = iter(self.batch_tokenizer.ids_many(texts))
        for item in prepared:
            if isinstance(item, Prepared):
                item.data.ids = next(encodings)
                item.length = len(item.data.ids)
        return prepared

    def sample(self, length: int) -> Prepared:
        """The special tokens around filler, as a tokenised text of `length` tokens would be."""
        return Prepared(length=max(2, min(length, self.max_seq_length)),
                        data=Sentence(filler_ids(self.tokenizer, length, self.max_seq_length)))

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


def load_tokenizer(path: Path, max_length: int) -> Any:
    """The directory's Rust tokenizer, truncating to `max_length`, unpadded: ~10x less
    overhead per text than the Python wrapper."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(path).backend_tokenizer
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()
    return tokenizer


def filler_ids(tokenizer: Any, length: int, max_length: int) -> list[int]:
    """`length` token ids (within 2..max_length): the tokenizer's special tokens around
    copies of an ordinary word piece."""
    specials = tokenizer.encode("").ids
    filler = tokenizer.encode(FILLER_TEXT, add_special_tokens=False).ids[:1] or [0]
    body = max(0, max(2, min(length, max_length)) - len(specials))
    return [*specials[:1], *filler * body, *specials[1:]][:max(2, min(length, max_length))]


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
