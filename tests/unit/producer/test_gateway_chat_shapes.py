"""The pure request and response shapes of /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Any

import pytest

from producer.gateway.errors import ApiError
from producer.gateway.generation import decode_entry, sse, worker_error
from producer.gateway.generation_shapes import (
    CHAT,
    TEXT,
    chunk,
    completion_response,
    openai_finish_reason,
    parse_chat_request,
    parse_completion_request,
    usage_chunk,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_fields_map_to_the_worker_payload() -> None:
    parsed = parse_chat_request({"model": "lm", "messages": MESSAGES, "max_tokens": 5,
                                 "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n",
                                 "n": 1, "user": "u", "stream": True,
                                 "stream_options": {"include_usage": True}})
    assert parsed.kind == CHAT and parsed.model == "lm" and parsed.stream
    assert parsed.include_usage
    assert parsed.payload == {"messages": MESSAGES, "max_new_tokens": 5, "temperature": 0.5,
                              "top_p": 0.9, "seed": 3, "stop": ["\n"], "stream": True}


def test_nulls_are_absent_and_defaults_are_the_workers() -> None:
    parsed = parse_chat_request({"model": "lm", "messages": MESSAGES, "temperature": None,
                                 "stop": None, "n": None, "stream": None})
    assert parsed.payload == {"messages": MESSAGES, "stream": False}
    assert not parsed.stream and not parsed.include_usage


def test_max_completion_tokens_and_text_parts() -> None:
    parsed = parse_chat_request({"model": "lm", "max_completion_tokens": 7, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"},
                                       {"type": "text", "text": "b"}], "name": "x"}]})
    assert parsed.payload["max_new_tokens"] == 7
    assert parsed.payload["messages"] == [{"role": "system", "content": "ab"}]


def test_completion_prompt() -> None:
    parsed = parse_completion_request({"model": "lm", "prompt": "once", "max_tokens": 3})
    assert parsed.kind == TEXT and parsed.payload == {"prompt": "once", "max_new_tokens": 3,
                                                      "stream": False}
    assert parse_completion_request({"model": "lm", "prompt": ["one"]}).payload["prompt"] == \
        "one"


CHAT_ERRORS = [
    ({"model": "lm", "messages": MESSAGES, "n": 10_000}, "n", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "n": True}, "n", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "n": 0}, "n", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1000},
     "top_logprobs", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs",
     "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "logprobs": 1}, "logprobs", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "functions": []}, "functions",
     "unsupported_parameter"),
    ({"model": "lm", "messages": MESSAGES, "tools": []}, "tools", "invalid_request"),
    ({"model": "lm"}, "messages", "invalid_request"),
    ({"model": "lm", "messages": []}, "messages", "invalid_request"),
    ({"model": "lm", "messages": [{"content": "x"}]}, "messages", "invalid_request"),
    ({"model": "lm", "messages": [{"role": "foo", "content": "x"}]}, "messages",
     "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty",
     "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "echo": True}, "echo", "unsupported_parameter"),
    ({"model": "lm", "messages": [{"role": "user", "content": 3}]}, "messages",
     "invalid_request"),
    ({"model": "lm", "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages", "unsupported_parameter"),
    ({"messages": MESSAGES}, "model", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "max_tokens": 0}, "max_tokens", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "max_tokens": 1, "max_completion_tokens": 1},
     "max_completion_tokens", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "temperature": 2.5}, "temperature",
     "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "top_p": 0}, "top_p", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "seed": 1.5}, "seed", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "stop": ["a"] * 5}, "stop", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "stop": [""]}, "stop", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "stop": ["x" * 1001]}, "stop", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "stream": "yes"}, "stream", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options", "invalid_request"),
    ({"model": "lm", "messages": MESSAGES, "user": 5}, "user", "invalid_request"),
    ([1], None, "invalid_request"),
]


def test_null_and_neutral_values_of_unsupported_fields_are_accepted() -> None:
    """Clients that send every field, at its default or null, still work."""
    body = {"model": "lm", "messages": [{"role": "developer", "content": "be brief"},
                                        *MESSAGES],
            "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False,
            "echo": None, "tools": None, "logit_bias": None}
    parsed = parse_chat_request(body)
    assert parsed.payload["messages"][0] == {"role": "system", "content": "be brief"}
    assert "presence_penalty" not in parsed.payload


@pytest.mark.parametrize("body, param, code", CHAT_ERRORS)
def test_chat_errors_name_the_field(body: Any, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_chat_request(body)
    assert raised.value.status == 400 and raised.value.param == param
    assert raised.value.code == code


@pytest.mark.parametrize("body, code", [
    ({"model": "lm", "prompt": [1, 2]}, "unsupported_input"),
    ({"model": "lm", "prompt": [[1, 2]]}, "unsupported_input"),
    ({"model": "lm", "prompt": []}, "invalid_request"),
    ({"model": "lm"}, "invalid_request"),
    ({"model": "lm", "prompt": "x", "messages": MESSAGES}, "unsupported_parameter"),
    ({"model": "lm", "prompt": "x", "echo": True}, "unsupported_parameter"),
])
def test_completion_errors(body: Any, code: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_completion_request(body)
    assert raised.value.status == 400 and raised.value.code == code


RESULT = {"text": "Paris", "tokens": 2, "prompt_tokens": 9, "finish_reason": "stop"}


def test_chat_completion_response() -> None:
    parsed = parse_chat_request({"model": "lm", "messages": MESSAGES})
    body = completion_response(parsed, "r1", 100, RESULT)
    assert body == {"id": "chatcmpl-r1", "object": "chat.completion", "created": 100,
                    "model": "lm", "choices": [{
                        "index": 0, "finish_reason": "stop", "logprobs": None,
                        "message": {"role": "assistant", "content": "Paris"}}],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def test_text_completion_response_without_prompt_tokens() -> None:
    parsed = parse_completion_request({"model": "lm", "prompt": "x"})
    body = completion_response(parsed, "r2", 100, {"text": "y", "tokens": 1,
                                                   "finish_reason": "length"})
    assert body["id"] == "cmpl-r2" and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                "text": "y"}]
    assert body["usage"] == {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}


@pytest.mark.parametrize("worker, openai", [
    ("stop", "stop"), ("length", "length"), ("cancelled", "stop"), ("tool_calls", "tool_calls"),
    ("content_filter", "content_filter"), ("something-new", "stop"), (None, "stop")])
def test_finish_reasons_are_openai_values(worker: Any, openai: str) -> None:
    assert openai_finish_reason(worker) == openai
    parsed = parse_chat_request({"model": "lm", "messages": MESSAGES})
    body = completion_response(parsed, "r", 1, {**RESULT, "finish_reason": worker})
    assert body["choices"][0]["finish_reason"] == openai


def test_chunks() -> None:
    chat = parse_chat_request({"model": "lm", "messages": MESSAGES, "stream": True})
    first = chunk(chat, "r", 5, "", first=True)
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-r"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk(chat, "r", 5, "ab")["choices"][0]["delta"] == {"content": "ab"}
    last = chunk(chat, "r", 5, None, "length")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    text = parse_completion_request({"model": "lm", "prompt": "x", "stream": True})
    piece = chunk(text, "r", 5, "ab")
    assert piece["object"] == "text_completion" and piece["choices"][0]["text"] == "ab"
    final = usage_chunk(chat, "r", 5, RESULT)
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 11
    assert "usage" not in piece  # without include_usage, no usage key at all
    counted = parse_chat_request({"model": "lm", "messages": MESSAGES, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert chunk(counted, "r", 5, "ab")["usage"] is None  # as OpenAI: set on the last only


def test_sse_and_entries() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert decode_entry(b'{"type":"delta","text":"x"}')["text"] == "x"
    with pytest.raises(ValueError):
        decode_entry(b'{"ok":true}')


def test_worker_errors_name_the_input_field() -> None:
    error = worker_error({"ok": False, "error": {"code": "invalid_request",
                                                 "message": "bad"}}, "messages")
    assert (error.status, error.code, error.param) == (400, "invalid_request", "messages")
    assert worker_error({"ok": False, "error": {"code": "model_error"}}, "prompt").status == 500


def test_worker_refusals_name_max_tokens_and_a_long_prompt_as_openai_does() -> None:
    """By the envelope's `field` and `reason`, whatever the message says."""
    too_many = worker_error({"ok": False, "error": {
        "code": "invalid_request", "message": "any wording", "field": "max_new_tokens"}},
        "messages")
    assert (too_many.status, too_many.param, too_many.code) == (400, "max_tokens",
                                                                "invalid_request")
    too_long = worker_error({"ok": False, "error": {
        "code": "invalid_request", "message": "any wording", "reason": "context_window"}},
        "prompt")
    assert (too_long.param, too_long.code) == ("prompt", "context_length_exceeded")
    hot = worker_error({"ok": False, "error": {
        "code": "invalid_request", "message": "x", "field": "temperature"}}, "prompt")
    assert (hot.param, hot.code) == ("temperature", "invalid_request")
    chat = worker_error({"ok": False, "error": {
        "code": "invalid_request", "message": "x", "field": "prompt"}}, "messages")
    assert chat.param == "messages"
