"""What a local sentence-transformers or Hugging Face encoder directory says about itself.

A sentence-transformers directory lists its modules in `modules.json`: a Transformer (the
Hugging Face model, in the module's `path`, often the directory itself), a Pooling module
(`1_Pooling/config.json`: which pooling), and maybe a Normalize module (L2 normalisation).
The Transformer's `sentence_bert_config.json` gives `max_seq_length`. A plain Hugging Face
directory (no `modules.json`) is pooled by the mean and not normalised, as sentence-
transformers itself wraps one; its length limit is the model's (`max_position_embeddings`,
lowered to the tokenizer's `model_max_length`). Modules that change the vectors and are not
implemented here (Dense, ...) are refused by name rather than silently left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLINGS = ("mean", "cls", "lasttoken", "max", "mean_sqrt_len_tokens")
# 1_Pooling/config.json's flag -> the pooling it turns on
POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}
NO_EFFECT_MODULES = ("Transformer", "Pooling", "Normalize")
LENGTH_UNSET = 10**6  # a tokenizer's model_max_length above this means "not set"


class EncoderDirError(ValueError):
    """The directory is not an encoder this worker can run as its authors meant."""


@dataclass(frozen=True, slots=True)
class EncoderLayout:
    """How to run the encoder: where its Hugging Face model is, and what follows it."""

    model_path: Path
    pooling: str
    normalize: bool
    max_seq_length: int


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EncoderDirError(f"cannot read {path}: {exc}") from None


def read_layout(path: Path) -> EncoderLayout:
    """The layout of the directory `path` (sentence-transformers or plain Hugging Face)."""
    if not path.is_dir():
        raise EncoderDirError(f"no such model directory: {path}")
    modules = read_json(path / "modules.json") if (path / "modules.json").exists() else []
    if not isinstance(modules, list):
        raise EncoderDirError(f"{path / 'modules.json'} is not a list of modules")
    by_type = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
               if isinstance(m, dict)}
    unknown = sorted(set(by_type) - set(NO_EFFECT_MODULES))
    if unknown:
        raise EncoderDirError(f"{path}: modules {unknown} are not supported (only "
                              f"{list(NO_EFFECT_MODULES)})")
    model_path = path / str(by_type.get("Transformer", {}).get("path", ""))
    pooling = "mean"
    if "Pooling" in by_type:
        pooling = pooling_of(read_json(path / str(by_type["Pooling"]["path"]) / "config.json"))
    return EncoderLayout(model_path, pooling, "Normalize" in by_type,
                         max_length_of(model_path))


def pooling_of(config: Any) -> str:
    """The one pooling a 1_Pooling/config.json turns on."""
    if not isinstance(config, dict):
        raise EncoderDirError("1_Pooling/config.json is not an object")
    modes = [mode for flag, mode in POOLING_FLAGS.items() if config.get(flag) is True]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise EncoderDirError(f"pooling {modes or 'none'} is not supported: one of "
                              f"{list(POOLINGS)} must be on")
    return modes[0]


def max_length_of(model_path: Path) -> int:
    """sentence_bert_config.json's max_seq_length, else the model's own limit."""
    sbert = model_path / "sentence_bert_config.json"
    if sbert.exists():
        length = read_json(sbert).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            return length
    return model_limit(model_path)


def model_limit(model_path: Path) -> int:
    """max_position_embeddings, lowered to the tokenizer's model_max_length when it sets
    one (RoBERTa's 514 positions hold 512 tokens)."""
    config = read_json(model_path / "config.json")
    limit = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if not isinstance(limit, int) or limit <= 0:
        raise EncoderDirError(f"{model_path / 'config.json'} has no max_position_embeddings: "
                              "give max_seq_length in model_options")
    tokenizer_config = model_path / "tokenizer_config.json"
    said = read_json(tokenizer_config).get("model_max_length") \
        if tokenizer_config.exists() else None
    if isinstance(said, int | float) and 0 < said < LENGTH_UNSET:
        limit = min(limit, int(said))
    return limit
