"""bfloat16 against float32 on real text (issue 45), where `dtype auto` picks bf16: the
encoder kind's embeddings (min cosine >= 0.999) and the reranker's order. MiniLM's is in
tests/redis/single/test_precision.py. Skipped on a CPU without fast bf16, where auto keeps
float32 (bf16 there is emulated: slow, and not what any default serves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.rigs.paths import REPO_ROOT
from tests.rigs.tiny_encoders import build_tiny_cross_encoder, build_tiny_encoder
from worker.execution.executor import cpu_bf16_support
from worker.models import create_model

pytestmark = pytest.mark.skipif(cpu_bf16_support() is None, reason=(
    "this CPU has no fast bf16 (AMX tiles or AVX-512 BF16): dtype auto keeps float32"))
SENTENCES = (REPO_ROOT / "examples" / "sentences.txt").read_text().splitlines()[:32]
QUERY = "how does a worker batch requests from Redis streams?"


def outputs(kind: str, path: Path, dtype: torch.dtype, payloads: list[Any]) -> torch.Tensor:
    model = create_model(kind, {"path": str(path)})
    model.dtype = dtype
    model.load(torch.device("cpu"))
    items = [model.prepare(payload, len(str(payload))) for payload in payloads]
    with torch.inference_mode():
        return torch.as_tensor(model.forward(model.collate(items))).float()


def test_the_encoder_kind_in_bfloat16_matches_float32(tmp_path: Path) -> None:
    path = build_tiny_encoder(tmp_path / "encoder", "mean", True)
    payloads = [{"text": text} for text in SENTENCES]
    fp32, bf16 = (outputs("encoder", path, dtype, payloads)
                  for dtype in (torch.float32, torch.bfloat16))
    cosine = F.cosine_similarity(fp32, bf16, dim=1)
    assert cosine.min().item() >= 0.999, cosine.min().item()


def test_the_reranker_in_bfloat16_keeps_the_float32_order(tmp_path: Path) -> None:
    path = build_tiny_cross_encoder(tmp_path / "cross")
    payloads = [{"query": QUERY, "text": text} for text in SENTENCES[:12]]
    fp32, bf16 = (outputs("reranker", path, dtype, payloads).flatten()
                  for dtype in (torch.float32, torch.bfloat16))
    # the logits leave the model in bf16 (8 bits of mantissa): two texts whose fp32 logits
    # are within 2 bf16 steps of each other are a tie there; every other pair keeps its order
    # (the tiny cross-encoder's random weights give close logits; no real one is cached)
    step = 2 * fp32.abs().clamp(min=2 ** -126) * 2 ** -7
    for i in range(len(fp32)):
        for j in range(len(fp32)):
            if fp32[i] - fp32[j] > max(step[i], step[j]):
                assert bf16[i] > bf16[j], (i, j, fp32[i].item(), fp32[j].item())
    assert bf16.argmax() == fp32.argmax() or bf16.max() == bf16[fp32.argmax()]
