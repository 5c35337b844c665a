"""OpenAI's request and response shapes for /v1/embeddings and /v1/models.

Pure: validation raises `ApiError` (400) naming the offending field, and responses are plain
dicts; the routes in app.py only move data between these and Redis.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer.gateway.errors import ApiError, invalid, refuse_unsupported

ENCODING_FORMATS = ("float", "base64")
KNOWN_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated POST /v1/embeddings body."""

    model: str
    inputs: list[str]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embedding_request(body: Any, max_inputs: int) -> EmbeddingRequest:
    """Validate the JSON body; token-id inputs are refused (the workers take text)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    refuse_unsupported(body, KNOWN_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string", "model")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise invalid(f"'encoding_format' must be one of {list(ENCODING_FORMATS)}, got "
                      f"{encoding_format!r}", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or dimensions < 1):
        raise invalid("'dimensions' must be a positive integer", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    return EmbeddingRequest(model, parse_inputs(body.get("input"), max_inputs),
                            encoding_format, dimensions)


def parse_inputs(value: Any, max_inputs: int) -> list[str]:
    """A string or a non-empty list of strings; token ids (ints, lists of ints) are refused."""
    if isinstance(value, str):
        if not value:
            raise invalid("'input' must not be an empty string", "input")
        return [value]
    if value is None:
        raise invalid("'input' is required: a string or a list of strings", "input")
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of strings", "input")
    if not value:
        raise invalid("'input' must not be an empty list", "input")
    if len(value) > max_inputs:
        raise invalid(f"'input' holds {len(value)} items, above the limit of {max_inputs}",
                      "input")
    for index, item in enumerate(value):
        if isinstance(item, int | list) and not isinstance(item, bool):
            raise invalid("token-id inputs are not supported: send text", "input",
                          "unsupported_input")
        if not isinstance(item, str) or not item:
            raise invalid(f"'input[{index}]' must be a non-empty string", "input")
    return list(value)


def encode_embedding(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """As given, or base64 of little-endian float32 (what the OpenAI SDKs decode)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def decode_base64_embedding(data: str) -> list[float]:
    """The inverse of encode_embedding(..., "base64"), for tests and clients."""
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def check_dimensions(request: EmbeddingRequest, size: int) -> None:
    """`dimensions` is only accepted when it equals the model's size (no truncation)."""
    if request.dimensions is not None and request.dimensions != size:
        raise invalid(f"'dimensions' must equal the model's embedding size of {size} "
                      f"(got {request.dimensions}); other sizes are not supported",
                      "dimensions", "unsupported_dimensions")


def embeddings_response(request: EmbeddingRequest,
                        results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's list of embeddings, with usage summed from the workers' token counts."""
    tokens = sum(int(result.get("tokens", 0)) for result in results)
    data = [{"object": "embedding", "index": index,
             "embedding": encode_embedding(result["embedding"], request.encoding_format)}
            for index, result in enumerate(results)]
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def embedding_of(result: Any) -> list[float]:
    """A worker's result, checked to be an embedding model's answer."""
    if not isinstance(result, dict) or not isinstance(result.get("embedding"), list):
        raise ApiError(500, "the model's result holds no 'embedding': not an embedding model",
                       "not_an_embedding_model", "model")
    embedding: list[float] = result["embedding"]
    return embedding


def models_response(models: Sequence[tuple[str, int, str | None]]) -> dict[str, Any]:
    """(name, created Unix seconds, kind) triples as OpenAI's model list."""
    return {"object": "list", "data": [model_object(*model) for model in models]}


def model_object(name: str, created: int, kind: str | None) -> dict[str, Any]:
    """OpenAI's model object, and what the model serves (`kind`: embedding, generative,
    reranker; null when its workers did not say), so a client can pick the route."""
    return {"id": name, "object": "model", "created": created, "owned_by": "redbatch",
            "kind": kind}
