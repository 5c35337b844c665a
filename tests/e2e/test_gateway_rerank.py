"""POST /rerank, /v1/rerank and /v2/rerank through a real HTTP server, a real Redis and a
reranker worker on the tiny cross-encoder (tests/rigs/tiny_encoders.py): TEI's and Cohere's
shapes, routing and refusal by the kind the workers announce, and /health."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from producer.gateway.rerank_shapes import parse_rerank_request
from tests.e2e.test_gateway import assert_openai_error, running_gateway
from tests.rigs.tiny_encoders import build_tiny_cross_encoder

QUERY = "where did the cat sit?"
DOCS = ["The cat sat on the mat.", "Redis streams batch requests.", "x", "cats sit on mats"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("rerank") / "cross")


@pytest.fixture(scope="module")
def expected(cross_encoder: Path) -> torch.Tensor:
    """The logits of (QUERY, doc), computed directly."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    encoded = tokenizer([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    with torch.inference_mode():
        return model(**encoded).logits[:, 0]


@pytest.fixture
def stack(redis_url: str, worker_factory: Callable[..., Any],
          cross_encoder: Path) -> Callable[..., Any]:
    """stack(*other_models) -> a reranker worker (and echo workers), and a gateway's URL."""

    @contextmanager
    def run(*others: str) -> Iterator[str]:
        with worker_factory(model="reranker", model_options={"path": str(cross_encoder)},
                            max_wait_ms=10):
            if not others:
                with running_gateway(redis_url) as base_url:
                    yield base_url
                return
            with worker_factory(model=others[0]), running_gateway(redis_url) as base_url:
                yield base_url
    return run


def rerank(base_url: str, body: Any, path: str = "/v1/rerank") -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=30)


def test_tei_shape_ranks_by_score(stack: Callable[..., Any], expected: torch.Tensor) -> None:
    order = sorted(range(len(DOCS)), key=lambda i: -float(expected[i]))
    with stack() as base_url:
        plain = rerank(base_url, {"query": QUERY, "texts": DOCS}, "/rerank")
        raw = rerank(base_url, {"model": "reranker", "query": QUERY, "texts": DOCS,
                                "raw_scores": True, "return_text": True, "truncate": True})
        assert httpx.get(f"{base_url}/health", timeout=10).json() == {"ok": True}
    assert plain.status_code == 200, plain.text
    assert [item["index"] for item in plain.json()] == order
    scores = torch.tensor([item["score"] for item in plain.json()])
    assert torch.allclose(scores, torch.sigmoid(expected[order]), atol=1e-5)
    assert set(plain.json()[0]) == {"index", "score"}
    assert [(item["index"], item["text"]) for item in raw.json()] == [(i, DOCS[i]) for i in order]
    assert torch.allclose(torch.tensor([item["score"] for item in raw.json()]),
                          expected[order], atol=1e-4)


def test_cohere_shape_with_top_n(stack: Callable[..., Any], expected: torch.Tensor) -> None:
    order = sorted(range(len(DOCS)), key=lambda i: -float(expected[i]))
    documents = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    with stack() as base_url:
        response = rerank(base_url, {"model": "reranker", "query": QUERY,
                                     "documents": documents, "top_n": 2,
                                     "return_documents": True}, "/v2/rerank")
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [(item["index"], item["document"]["text"]) for item in results] == \
        [(i, DOCS[i]) for i in order[:2]]
    assert results[0]["relevance_score"] == pytest.approx(
        float(torch.sigmoid(expected[order[0]])), abs=1e-5)
    assert response.json()["meta"]["tokens"]["input_tokens"] > len(DOCS) * 3


def test_routes_refuse_by_the_announced_kind(stack: Callable[..., Any]) -> None:
    with stack("echo") as base_url:
        embedding = httpx.post(f"{base_url}/v1/embeddings",
                               json={"model": "reranker", "input": "x"}, timeout=30)
        chat = httpx.post(f"{base_url}/v1/chat/completions", json={
            "model": "reranker", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        on_echo = rerank(base_url, {"model": "echo", "query": QUERY, "texts": DOCS})
        missing = rerank(base_url, {"model": "nope", "query": QUERY, "texts": DOCS})
        defaulted = rerank(base_url, {"query": QUERY, "texts": DOCS})  # echo is no reranker
    for response in (embedding, chat):
        error = assert_openai_error(response, 400, "wrong_model_kind")
        assert "is a reranker model: use /v1/rerank" in error["message"]
    error = assert_openai_error(on_echo, 400, "wrong_model_kind")
    assert "is an embedding model: use /v1/embeddings" in error["message"]
    assert_openai_error(missing, 404, "model_not_found")
    assert defaulted.status_code == 200, defaulted.text


def test_no_reranker_and_bad_bodies(redis_url: str, worker_factory: Callable[..., Any],
                                    stack: Callable[..., Any]) -> None:
    with worker_factory(model="echo"), running_gateway(redis_url) as base_url:
        none = rerank(base_url, {"query": QUERY, "texts": DOCS})
    error = assert_openai_error(none, 404, "model_not_found")
    assert "no reranker has a live worker" in error["message"]
    with stack() as base_url:
        for body, param in (({"query": QUERY}, "texts"), ({"texts": DOCS}, "query"),
                            ({"query": QUERY, "texts": DOCS, "documents": DOCS}, "texts"),
                            ({"query": QUERY, "texts": [1]}, "texts"),
                            ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
                            ({"query": QUERY, "texts": DOCS, "raw_scores": "yes"}, "raw_scores"),
                            ({"query": QUERY, "texts": DOCS, "temperature": 1}, "temperature")):
            assert assert_openai_error(rerank(base_url, body), 400)["param"] == param, body
        still = rerank(base_url, {"query": QUERY, "texts": ["still serving"]})
    assert still.status_code == 200 and still.json()[0]["index"] == 0


def test_a_worker_that_announces_no_kind_and_answers_no_score_is_500(
        r: redis.Redis, redis_url: str, worker_factory: Callable[..., Any]) -> None:
    """A worker from before kinds (here: echo, its announcement stripped of its kind)."""
    with worker_factory(model="echo", maintenance_interval_s=60), \
            running_gateway(redis_url) as base_url:
        for key, field in (("redbatch:workers:echo", None), ("redbatch:models", "echo")):
            for name, value in r.hgetall(key).items():
                if field is None or name.decode() == field:
                    entry = json.loads(value)
                    entry.pop("kind")
                    r.hset(key, name, json.dumps(entry))
        response = rerank(base_url, {"model": "echo", "query": QUERY, "texts": DOCS})
    assert_openai_error(response, 500, "not_a_reranker_model")


def test_parse_limits_the_documents() -> None:
    with pytest.raises(Exception, match="above the limit of 3"):
        parse_rerank_request({"query": "q", "texts": ["a"] * 4}, max_inputs=3)
    parsed = parse_rerank_request({"query": "q", "documents": [{"text": "a"}, "b"]}, 3)
    assert (parsed.dialect, parsed.texts, parsed.model) == ("cohere", ["a", "b"], None)
