"""The request and response shapes of POST /rerank, /v1/rerank and /v2/rerank.

Two dialects, told apart by the body: TEI's (`{"query", "texts", "raw_scores",
"return_text"}` -> a list of `{"index", "score"}`) and Cohere's (`{"model", "query",
"documents", "top_n", "return_documents"}` -> `{"results": [{"index", "relevance_score"}]}`),
the one Jina, vLLM and infinity also speak. Both answer sorted by score, best first. Each
document becomes one worker request `{"query", "text"}` (worker/models/reranker.py).

Pure: validation raises `ApiError` (400) naming the offending field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from producer.gateway.errors import ApiError, invalid, refuse_unsupported

TEI, COHERE = "tei", "cohere"
# TEI's `truncate`/`truncation_direction` and Cohere's `max_chunks_per_doc`/`rank_fields`
# are accepted and change nothing: the worker always truncates a pair to the model's limit.
KNOWN_FIELDS = {"model", "query", "texts", "documents", "raw_scores", "return_text", "top_n",
                "return_documents", "truncate", "truncation_direction", "max_chunks_per_doc",
                "max_tokens_per_doc", "rank_fields", "user"}


@dataclass(frozen=True)
class RerankRequest:
    """A validated rerank body."""

    dialect: str
    model: str | None  # None: the one live reranker
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    top_n: int | None = None


def parse_rerank_request(body: Any, max_inputs: int) -> RerankRequest:
    """Validate the JSON body of either dialect."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    refuse_unsupported(body, KNOWN_FIELDS)
    if ("texts" in body) == ("documents" in body):
        raise invalid("send the documents as 'texts' (TEI) or 'documents' (Cohere), one of "
                      "the two", "texts")
    dialect, field = (TEI, "texts") if "texts" in body else (COHERE, "documents")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("'model' must be a non-empty string", "model")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise invalid("'query' is required and must be a non-empty string", "query")
    return RerankRequest(dialect, model, query, texts_of(body[field], field, max_inputs),
                         flag(body, "raw_scores"),
                         flag(body, "return_text" if dialect == TEI else "return_documents"),
                         top_n_of(body.get("top_n")))


def texts_of(value: Any, field: str, max_inputs: int) -> list[str]:
    """A non-empty list of strings (Cohere's documents may be `{"text": ...}` objects)."""
    if not isinstance(value, list) or not value:
        raise invalid(f"'{field}' must be a non-empty list of strings", field)
    if len(value) > max_inputs:
        raise invalid(f"'{field}' holds {len(value)} items, above the limit of {max_inputs}",
                      field)
    texts = []
    for index, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) and field == "documents" else item
        if not isinstance(text, str):
            raise invalid(f"'{field}[{index}]' must be a string", field)
        texts.append(text)
    return texts


def flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return bool(value)


def top_n_of(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise invalid("'top_n' must be a positive integer", "top_n")
    return value


def worker_payloads(request: RerankRequest) -> list[dict[str, str]]:
    """One worker request per document."""
    return [{"query": request.query, "text": text} for text in request.texts]


def check_scores(results: list[Any]) -> None:
    """500 unless every result is a reranker's answer (a worker from before kinds announces
    none, so an embedding model may get here)."""
    for result in results:
        if not (isinstance(result, dict) and all(
                isinstance(result.get(key), int | float) for key in ("score", "logit"))):
            raise ApiError(500, "the model's result holds no 'score': not a reranker model",
                           "not_a_reranker_model", "model")


def rerank_response(request: RerankRequest, results: list[dict[str, Any]]) -> Any:
    """The worker's results (in document order) ranked, in the request's dialect."""
    check_scores(results)
    key = "logit" if request.raw_scores else "score"
    ranked = sorted(range(len(results)), key=lambda i: -float(results[i][key]))
    ranked = ranked[:request.top_n] if request.top_n else ranked
    if request.dialect == TEI:
        return [{"index": i, "score": results[i][key],
                 **({"text": request.texts[i]} if request.return_text else {})}
                for i in ranked]
    tokens = sum(int(result.get("tokens", 0)) for result in results)
    return {"id": str(uuid.uuid4()),
            "results": [{"index": i, "relevance_score": results[i][key],
                         **({"document": {"text": request.texts[i]}}
                            if request.return_text else {})} for i in ranked],
            "meta": {"billed_units": {"search_units": 1}, "tokens": {"input_tokens": tokens}}}
