"""The logprob fields of the gateway (producer/gateway/logprob_shapes.py): what each route
accepts and sends the worker, and the worker's records in OpenAI's chat and completions
shapes."""

from __future__ import annotations

from typing import Any

import pytest

from producer.gateway.errors import ApiError
from producer.gateway.generation_shapes import (
    chunk,
    completion_response,
    parse_chat_request,
    parse_completion_request,
)
from producer.gateway.logprob_shapes import shaped, text_length

MESSAGES = [{"role": "user", "content": "hi"}]
RECORDS: list[dict[str, Any]] = [
    {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
     "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                      {"token": "Hi", "logprob": -1.25, "bytes": [72, 105]}]},
    {"token": "lo", "logprob": -0.125, "bytes": [108, 111],
     "top_logprobs": [{"token": "lo", "logprob": -0.125, "bytes": [108, 111]},
                      {"token": "p", "logprob": -3.0, "bytes": [112]}]},
]


def test_chat_asks_the_worker_for_top_logprobs_only_with_logprobs_true() -> None:
    def payload(**fields: Any) -> dict[str, Any]:
        return parse_chat_request({"model": "lm", "messages": MESSAGES, **fields}).payload

    assert payload(logprobs=True, top_logprobs=20)["logprobs"] == 20
    assert payload(logprobs=True)["logprobs"] == 0
    assert "logprobs" not in payload(logprobs=False) and "logprobs" not in payload()


@pytest.mark.parametrize("value", [21, -1, True, 2.0, "3"])
def test_completions_logprobs_is_an_integer_from_0_to_20(value: Any) -> None:
    assert parse_completion_request({"model": "lm", "prompt": "x", "logprobs": 5}
                                    ).payload["logprobs"] == 5
    with pytest.raises(ApiError) as raised:
        parse_completion_request({"model": "lm", "prompt": "x", "logprobs": value})
    assert raised.value.status == 400 and raised.value.param == "logprobs"
    assert raised.value.code == "invalid_request"


def test_chat_shape_is_the_records_as_content() -> None:
    parsed = parse_chat_request({"model": "lm", "messages": MESSAGES, "logprobs": True})
    answer = completion_response(parsed, "1-0", 0, {"text": "Hello", "logprobs": RECORDS})
    assert answer["choices"][0]["logprobs"] == {"content": RECORDS, "refusal": None}
    plain = parse_chat_request({"model": "lm", "messages": MESSAGES})
    assert completion_response(plain, "1-0", 0, {"text": "Hello"})["choices"][0][
        "logprobs"] is None


def test_completions_shape_has_the_four_lists_and_offsets_carry_across_chunks() -> None:
    parsed = parse_completion_request({"model": "lm", "prompt": "x", "logprobs": 2})
    answer = completion_response(parsed, "1-0", 0, {"text": "Hello", "logprobs": RECORDS})
    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.125],
        "top_logprobs": [{"Hel": -0.5, "Hi": -1.25}, {"lo": -0.125, "p": -3.0}],
        "text_offset": [0, 3]}
    second = shaped(False, RECORDS[1:], text_length(RECORDS[:1]))
    assert second is not None and second["text_offset"] == [3]
    streamed = chunk(parsed, "1-0", 0, "lo", logprobs=second)
    assert streamed["choices"][0]["logprobs"]["tokens"] == ["lo"]
