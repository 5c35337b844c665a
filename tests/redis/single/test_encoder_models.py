"""The `encoder` and `reranker` built-ins on tiny models built offline
(tests/rigs/tiny_encoders.py): each pooling and normalisation against a direct torch
computation, the directory's layout read as sentence-transformers reads it, cross-encoder
scores against a direct forward, and both kinds end to end through a real Redis worker, the
Client and the producer CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.nn.functional as F

from producer import Client
from tests.e2e.test_producer_cli import produce, results
from tests.rigs.tiny_encoders import (
    POSITIONS,
    Recording,
    build_tiny_cross_encoder,
    build_tiny_encoder,
)
from worker.models import ModelLoadError, create_model
from worker.models.ascii_tokenizer import CHARS_PER_TOKEN
from worker.models.encoder_dir import POOLINGS
from worker.models.reranker import RerankerModel

TEXTS = ["A cat sat on the mat.", "x", "Redis streams feed a worker that batches requests.",
         " ".join(f"word{n}" for n in range(100))]  # beyond 48 tokens: truncated
QUERY = "where did the cat sit?"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-encoders")


@pytest.fixture(scope="module")
def cross_encoder(models_dir: Path) -> Path:
    return build_tiny_cross_encoder(models_dir / "cross")


def encoder_dir(models_dir: Path, pooling: str, normalize: bool) -> Path:
    path = models_dir / f"{pooling}-{normalize}"
    return path if path.exists() else build_tiny_encoder(path, pooling, normalize)


def direct_embeddings(path: Path, pooling: str, normalize: bool,
                      max_length: int = 48) -> torch.Tensor:
    """The sentence-transformers recipe written out with transformers and torch."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(path).eval()(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    lengths = encoded["attention_mask"].sum(dim=1)
    pooled = {
        "cls": lambda: hidden[:, 0],
        "mean": lambda: (hidden * mask).sum(1) / lengths[:, None],
        "mean_sqrt_len_tokens": lambda: (hidden * mask).sum(1) / lengths[:, None].sqrt(),
        "max": lambda: hidden.masked_fill(mask == 0, -1e9).max(dim=1).values,
        "lasttoken": lambda: torch.stack([hidden[i, n - 1] for i, n in enumerate(lengths)]),
    }[pooling]()
    return F.normalize(pooled, dim=1) if normalize else pooled


def embed(path: Path, **options: Any) -> tuple[torch.Tensor, list[int]]:
    """The encoder built-in's embeddings of TEXTS, batched, and their token counts."""
    model = create_model("encoder", {"path": str(path), **options})
    model.load(CPU)
    items = model.prepare_many([({"text": text}, 1) for text in TEXTS])
    results = model.postprocess(model.forward(model.collate(items)), items)
    return (torch.tensor([list(r["embedding"]) for r in results]),
            [r["tokens"] for r in results])


# unnormalised: mean and mean_sqrt_len differ by a factor per row, which L2 normalisation hides
@pytest.mark.parametrize(("pooling", "normalize"), [
    *((p, True) for p in POOLINGS), ("mean", False), ("mean_sqrt_len_tokens", False)])
def test_each_pooling_as_the_directory_says(models_dir: Path, pooling: str,
                                            normalize: bool) -> None:
    path = encoder_dir(models_dir, pooling, normalize)
    got, tokens = embed(path)
    want = direct_embeddings(path, pooling, normalize)
    assert torch.allclose(embed(path, trace=False)[0], want, atol=1e-4)  # eager, as traced
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    norms = torch.linalg.vector_norm(got, dim=1)
    assert torch.allclose(norms, torch.ones(len(TEXTS)), atol=1e-4) is normalize
    assert max(tokens) == 48  # sentence_bert_config.json's max_seq_length


def test_options_override_the_directory(models_dir: Path) -> None:
    path = encoder_dir(models_dir, "mean", True)
    got, tokens = embed(path, pooling="cls", normalize=False, max_seq_length=16)
    assert max(tokens) == 16
    assert torch.allclose(got, direct_embeddings(path, "cls", False, max_length=16), atol=1e-4)


def test_a_plain_hugging_face_directory_is_mean_pooled_unnormalised(tmp_path: Path) -> None:
    path = build_tiny_encoder(tmp_path / "plain", max_seq_length=None)
    (path / "modules.json").unlink()
    model = create_model("encoder", {"path": str(path)})
    assert (model.layout.pooling, model.layout.normalize) == ("mean", False)
    assert model.max_seq_length == POSITIONS  # max_position_embeddings, below the tokenizer's 512
    got, _ = embed(path)
    assert torch.allclose(got, direct_embeddings(path, "mean", False, POSITIONS), atol=1e-4)


def test_directories_it_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    path = build_tiny_encoder(tmp_path / "dense")
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(
        [*modules, {"path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ModelLoadError, match=r"modules \['Dense'\] are not supported"):
        create_model("encoder", {"path": str(path)})
    with pytest.raises(ModelLoadError, match="needs a `path`"):
        create_model("encoder", {})
    with pytest.raises(ModelLoadError, match="no such model directory"):
        create_model("encoder", {"path": str(tmp_path / "missing")})
    with pytest.raises(ModelLoadError, match="pooling must be one of"):
        create_model("encoder", {"path": str(path), "pooling": "median"})
    with pytest.raises(ModelLoadError, match="one output label"):
        create_model("reranker", {"path": str(build_two_labels(tmp_path / "two"))})


def build_two_labels(path: Path) -> Path:
    build_tiny_cross_encoder(path)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def direct_scores(path: Path, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    """CrossEncoder's recipe: the pairs tokenised together, one logit, the sigmoid."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = tokenizer([QUERY] * len(texts), texts, padding=True, truncation=True,
                        max_length=POSITIONS, return_tensors="pt")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        logits = model(**encoded).logits[:, 0]
    return logits, encoded["attention_mask"].sum(dim=1).tolist()


def test_reranker_scores_equal_a_direct_forward(cross_encoder: Path) -> None:
    model = create_model("reranker", {"path": str(cross_encoder)})
    assert isinstance(model, RerankerModel)
    model.load(CPU)
    texts = [*TEXTS, " ".join(["long"] * 200)]  # the pair is truncated to the model's 64
    items = model.prepare_many([({"query": QUERY, "text": t}, 1) for t in texts])
    got = model.postprocess(model.forward(model.collate(items)), items)
    logits, tokens = direct_scores(cross_encoder, texts)
    assert [r["tokens"] for r in got] == tokens and max(tokens) == POSITIONS
    assert torch.allclose(torch.tensor([r["logit"] for r in got]), logits, atol=1e-4)
    assert torch.allclose(torch.tensor([r["score"] for r in got]), torch.sigmoid(logits),
                          atol=1e-5)
    assert len({round(r["score"], 4) for r in got}) == len(texts)  # the texts are told apart
    assert model.sample(20).length == 20
    model.tokenizer = recording = Recording(model.tokenizer)  # a hostile megabyte is cut first
    [huge] = model.prepare_many([({"query": "q " * 400_000, "text": "t " * 400_000}, 1)])
    assert not isinstance(huge, Exception) and huge.length == POSITIONS
    assert 0 < recording.longest <= POSITIONS * CHARS_PER_TOKEN
    assert isinstance(model.scorer, torch.jit.ScriptModule)  # on a CPU: traced, as checked
    eager = create_model("reranker", {"path": str(cross_encoder), "trace": False})
    eager.load(CPU)
    assert not isinstance(eager.scorer, torch.jit.ScriptModule)
    assert torch.allclose(eager.forward(eager.collate(items)), logits, atol=1e-4)


def test_an_encoder_worker_end_to_end(redis_url: str, r: redis.Redis,
                                      worker_factory: Callable[..., Any],
                                      models_dir: Path) -> None:
    path = encoder_dir(models_dir, "cls", True)
    want = direct_embeddings(path, "cls", True)
    client = Client(redis_url, "encoder")
    with worker_factory(model="encoder", model_options={"path": str(path)}, max_wait_ms=20):
        got = [client.infer({"text": text}, timeout=30) for text in TEXTS]
        entry = json.loads(r.hget("redbatch:models", "encoder") or "{}")
        assert client.models()["encoder"].kind == "embedding"
    client.close()
    assert entry["kind"] == "embedding"
    for result, expected in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(result["embedding"]), expected, atol=1e-4)


def test_a_reranker_worker_end_to_end(redis_url: str, r: redis.Redis,
                                      worker_factory: Callable[..., Any],
                                      cross_encoder: Path) -> None:
    logits, _ = direct_scores(cross_encoder, TEXTS)
    client = Client(redis_url, "reranker")
    lines = "".join(json.dumps({"id": f"d{n}", "query": QUERY, "text": text}) + "\n"
                    for n, text in enumerate(TEXTS))
    with worker_factory(model="reranker", model_options={"path": str(cross_encoder)},
                        max_wait_ms=20):
        ids = client.submit_many([{"query": QUERY, "text": t} for t in TEXTS] + [{"q": "x"}])
        *served, refused = [client.wait(request_id, timeout=30) for request_id in ids]
        entry = json.loads(r.hget("redbatch:models", "reranker") or "{}")
        done = produce("--redis-url", redis_url, "--model", "reranker", stdin=lines)
    client.close()
    assert entry["kind"] == "reranker"
    scores = torch.tensor([envelope["result"]["score"] for envelope in served])
    assert torch.allclose(scores, torch.sigmoid(logits), atol=1e-5)
    assert refused["ok"] is False and refused["error"]["code"] == "invalid_request"
    assert refused["error"]["field"] == "query"
    assert done.returncode == 0, done.stderr
    by_id = {line["id"]: line["result"]["score"] for line in results(done.stdout)}
    assert list(by_id) == [f"d{n}" for n in range(len(TEXTS))]
    assert torch.allclose(torch.tensor(list(by_id.values())), scores, atol=1e-6)
