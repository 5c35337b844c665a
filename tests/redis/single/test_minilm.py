"""MiniLM through the worker matches sentence-transformers' recipe computed with transformers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from producer import Client
from producer.protocol import CONTENT_TYPES
from worker.models.minilm import MAX_SEQ_LENGTH, MiniLMModel, bundled_model_path
from worker.policy.batching import bucket_of

TEXTS = [
    "A cat sat on the mat.",
    "Redis Streams feed a worker that batches requests of similar length.",
    "Ünïcödé and emoji 🙂 are tokenised too",
    "x",
    " ".join(f"word{n}" for n in range(400)),  # far beyond 256 tokens: truncated, not refused
    "Mean pooling over the attention mask, then L2 normalisation. " * 6,
]


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, list[int]]:
    """Embeddings and token counts computed directly with transformers, batch padded."""
    from transformers import AutoModel, AutoTokenizer

    path = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH,
                        return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1), encoded["attention_mask"].sum(dim=1).tolist()


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
def test_embeddings_match_the_reference(redis_url: str, worker_factory: Callable[..., Any],
                                        reference: tuple[torch.Tensor, list[int]],
                                        content_type: str) -> None:
    expected, token_counts = reference
    client = Client(redis_url, "minilm", content_type=content_type)
    with worker_factory(model="minilm", max_wait_ms=50, merge_tokens=0):  # buckets apart
        ids = client.submit_many([{"text": text} for text in TEXTS])
        envelopes = [client.wait(request_id, timeout=60) for request_id in ids]
    client.close()
    assert max(token_counts) == MAX_SEQ_LENGTH
    for envelope, want, tokens in zip(envelopes, expected, token_counts, strict=True):
        assert envelope["ok"], envelope
        result, meta = envelope["result"], envelope["meta"]
        got = torch.tensor(result["embedding"])
        assert got.shape == (384,)
        assert torch.linalg.vector_norm(got).item() == pytest.approx(1.0, abs=1e-4)
        assert F.cosine_similarity(got, want, dim=0).item() >= 0.999
        assert result["tokens"] == tokens
        assert meta["bucket"] == bucket_of(tokens, MiniLMModel.default_bucket_boundaries)
        assert tokens <= meta["padded_length"] <= MAX_SEQ_LENGTH


def test_payloads_other_than_a_text_object_are_invalid(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "minilm")
    with worker_factory(model="minilm", max_wait_ms=0):
        ids = client.submit_many(["just a string", {"text": 5}, {"txt": "hi"}, [1, 2], None])
        refused = [client.wait(request_id, timeout=30) for request_id in ids]
        served = client.infer({"text": "still serving"}, timeout=30)
    client.close()
    for envelope in refused:
        assert envelope["ok"] is False and envelope["error"]["code"] == "invalid_request"
        assert '{"text": <string>}' in envelope["error"]["message"]
    assert served["tokens"] == 4  # [CLS] still serving [SEP]


@pytest.fixture(scope="module")
def eager() -> MiniLMModel:
    model = MiniLMModel(trace=False)
    model.load(torch.device("cpu"))
    return model


def test_on_a_cpu_the_encoder_is_traced_and_gives_eagers_results(eager: MiniLMModel) -> None:
    from tests.rigs.workers import loaded_model

    traced: Any = loaded_model("minilm", {})
    assert isinstance(traced.encoder, torch.jit.ScriptModule)
    assert not isinstance(eager.encoder, torch.jit.ScriptModule)
    for texts in (TEXTS, TEXTS[:1], TEXTS[3:5]):  # shapes it was not traced with
        items = [traced.prepare({"text": text}, len(text)) for text in texts]
        with torch.inference_mode():
            got = traced.forward(traced.collate(items))
            want = eager.forward(eager.collate(items))
        assert torch.allclose(got, want, atol=1e-5)


def test_a_trace_that_fails_leaves_the_encoder_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("cannot trace this")

    monkeypatch.setattr(torch.jit, "trace", broken)
    model = MiniLMModel()
    model.load(torch.device("cpu"))
    assert not isinstance(model.encoder, torch.jit.ScriptModule)
    item = model.prepare({"text": "still works"}, 11)
    with torch.inference_mode():
        assert model.forward(model.collate([item])).shape == (1, 384)
