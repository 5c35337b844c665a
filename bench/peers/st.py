"""sentence-transformers' `encode` of the bundled all-MiniLM-L6-v2, in float32 and bfloat16.

`encode` sorts by length and tokenises inside its call, so its clock covers what a user
waits for; torch's threads are set to the cores before each call (redbatch's offline
layouts change that process-wide setting).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bench.peers.systems import Skipped, System, missing
from worker.models.minilm import bundled_model_path


def encoder(model: Any, batch_size: int, threads: int) -> Any:
    def encode(texts: Sequence[str]) -> Any:
        torch.set_num_threads(threads)
        return model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                            show_progress_bar=False)
    return encode


def systems(batch_sizes: Sequence[int], threads: int) -> tuple[list[System], list[Skipped]]:
    why = missing("sentence_transformers")
    if why:
        return [], [Skipped("sentence-transformers", "sentence-transformers", why)]
    from sentence_transformers import SentenceTransformer

    found = []
    for dtype in (torch.float32, torch.bfloat16):
        model = SentenceTransformer(str(bundled_model_path()), device="cpu").to(dtype)
        name = str(dtype).removeprefix("torch.")
        found.append(System(f"sentence-transformers {name}", "sentence-transformers", name,
                            {f"batch {b}": encoder(model, b, threads) for b in batch_sizes},
                            note="encode(), torch threads = cores"))
    return found, []
