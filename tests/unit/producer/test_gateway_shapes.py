"""The gateway's pure parts: request validation, base64 encoding, error mapping, settings."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.gateway import errors
from producer.gateway.errors import ApiError
from producer.gateway.openai_shapes import (
    EmbeddingRequest,
    check_dimensions,
    decode_base64_embedding,
    embedding_of,
    embeddings_response,
    encode_embedding,
    models_response,
    parse_embedding_request,
)
from producer.gateway.serve import as_environment
from producer.gateway.settings import GatewaySettingsError, load_gateway_settings
from producer.protocol import ErrorCode


def refused(body: object, max_inputs: int = 10) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_embedding_request(body, max_inputs)
    assert raised.value.status == 400
    return raised.value


def test_a_string_or_list_of_strings() -> None:
    one = parse_embedding_request({"model": "m", "input": "hi", "user": "u"}, 10)
    assert one == EmbeddingRequest("m", ["hi"], "float", None)
    many = parse_embedding_request({"model": "m", "input": ["a", "b"], "encoding_format":
                                    "base64", "dimensions": 384}, 10)
    assert many == EmbeddingRequest("m", ["a", "b"], "base64", 384)
    assert parse_embedding_request({"model": "m", "input": "x", "encoding_format": None},
                                   1).encoding_format == "float"


@pytest.mark.parametrize("value", [[1, 2], [[1, 2]], [0]])
def test_token_ids_are_refused(value: object) -> None:
    error = refused({"model": "m", "input": value})
    assert error.param == "input" and error.code == "unsupported_input"


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["a"] * 11}, "input"),
    ({"model": "m", "input": [True]}, "input"),
    ({"model": "m", "input": {"text": "x"}}, "input"),
    ({"model": "", "input": "x"}, "model"),
    ({"model": 3, "input": "x"}, "model"),
    ({"model": "m", "input": "x", "dimensions": True}, "dimensions"),
    ({"model": "m", "input": "x", "dimensions": -1}, "dimensions"),
    ({"model": "m", "input": "x", "encoding_format": "float16"}, "encoding_format"),
    ({"model": "m", "input": "x", "user": 5}, "user"),
    ({"model": "m", "input": "x", "extra": 5}, "extra"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": ["a", ""]}, "input"),
    ("text", None),
])
def test_bad_fields_name_their_param(body: object, param: str | None) -> None:
    assert refused(body).param == param


def test_dimensions_must_equal_the_size() -> None:
    check_dimensions(EmbeddingRequest("m", ["x"], dimensions=None), 384)
    check_dimensions(EmbeddingRequest("m", ["x"], dimensions=384), 384)
    with pytest.raises(ApiError) as raised:
        check_dimensions(EmbeddingRequest("m", ["x"], dimensions=128), 384)
    assert raised.value.status == 400 and raised.value.param == "dimensions"


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64))
def test_base64_is_little_endian_float32(vector: list[float]) -> None:
    encoded = encode_embedding(vector, "base64")
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert raw == struct.pack(f"<{len(vector)}f", *vector)
    assert np.frombuffer(raw, dtype="<f4").tolist() == vector  # what the SDKs do
    assert decode_base64_embedding(encoded) == vector


def test_responses() -> None:
    request = EmbeddingRequest("minilm", ["a", "b"])
    body = embeddings_response(request, [{"embedding": [0.5], "tokens": 3},
                                         {"embedding": [0.25], "tokens": 4}])
    assert body == {"object": "list", "model": "minilm",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5]},
                             {"object": "embedding", "index": 1, "embedding": [0.25]}],
                    "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    assert models_response([("echo", 12, "embedding"), ("x", 13, None)]) == {
        "object": "list", "data": [
            {"id": "echo", "object": "model", "created": 12, "owned_by": "redbatch",
             "kind": "embedding"},
            {"id": "x", "object": "model", "created": 13, "owned_by": "redbatch", "kind": None}]}
    with pytest.raises(ApiError) as raised:
        embedding_of({"text": "echoed"})
    assert raised.value.status == 500


@pytest.mark.parametrize("code, status", [
    (ErrorCode.INVALID_REQUEST, 400), (ErrorCode.TOO_LARGE, 413),
    (ErrorCode.DEADLINE_EXCEEDED, 504), (ErrorCode.MODEL_ERROR, 500),
    (ErrorCode.INTERNAL, 500), (ErrorCode.DEAD_LETTER, 500), ("something_new", 500),
])
def test_worker_codes_map_to_statuses(code: str, status: int) -> None:
    error = errors.from_worker({"code": str(code), "message": "why"})
    assert error.status == status and "why" in error.message
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"]


def test_every_worker_code_is_mapped() -> None:
    assert set(errors.WORKER_STATUS) == set(ErrorCode)


def test_error_shapes() -> None:
    busy = errors.overloaded(10, 5)
    assert busy.status == 429 and busy.headers["Retry-After"] == "1"
    assert busy.body()["error"]["type"] == "rate_limit_error"
    assert errors.unknown_model("x").status == 404
    assert errors.no_live_worker("x").status == 503
    assert errors.timed_out(0.5).status == 504
    cut = errors.stream_timed_out(0.5, 3)
    assert cut.status == 504 and "cancelled after 3 chunk(s)" in cut.message
    assert ApiError(418, "teapot").type == "invalid_request_error"


def test_settings_from_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDBATCH_API_KEYS", "a, b,,")
    monkeypatch.setenv("REDBATCH_PORT", "9000")
    monkeypatch.setenv("REDBATCH_MODEL", "minilm")  # a worker's setting: ignored here
    settings = load_gateway_settings(port="8100", max_backlog=None)
    assert settings.api_keys == ["a", "b"] and settings.port == 8100
    assert settings.max_backlog is None
    env = as_environment(settings)
    assert env["REDBATCH_API_KEYS"] == "a,b" and "REDBATCH_MAX_BACKLOG" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_gateway_settings() == settings
    with pytest.raises(GatewaySettingsError, match="port"):
        load_gateway_settings(port="-1")


def test_the_gateway_password_setting_reaches_its_client_and_child_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from producer.gateway.app import Gateway

    monkeypatch.setenv("REDBATCH_REDIS_PASSWORD", "p@ss:w/rd")
    settings = load_gateway_settings()
    assert "p@ss" not in repr(settings)
    assert as_environment(settings)["REDBATCH_REDIS_PASSWORD"] == "p@ss:w/rd"
    pool = Gateway(settings).redis.connection_pool
    assert pool.connection_kwargs["password"] == "p@ss:w/rd"
    with pytest.raises(GatewaySettingsError) as raised:
        load_gateway_settings(redis_password="")
    assert "got" not in str(raised.value)


def test_a_shed_request_is_429_with_the_workers_retry_time() -> None:
    from producer.gateway.errors import from_worker

    error = from_worker({"code": "overloaded", "message": "over the latency target",
                         "retry_after_ms": 1200})
    assert error.status == 429 and error.code == "overloaded"
    assert error.headers == {"Retry-After": "2"}


def test_a_payload_over_the_workers_limit_is_413() -> None:
    error = errors.from_worker({"code": "invalid_request", "message": "payload is 2000000 "
                                "bytes", "field": "payload", "reason": "payload_too_large"})
    assert (error.status, error.code, error.param) == (413, "payload_too_large", "input")
    assert errors.from_worker(None).status == 500
