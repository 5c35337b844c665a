"""Penalties, logit_bias and min_tokens end to end: the official `openai` client, the
gateway, a real Redis and a worker serving the tiny GPT-2 (the rig of test_gateway_chat.py);
hostile and bad values answered 400 naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_gateway import assert_openai_error, gateway_factory, sdk  # noqa: F401
from tests.e2e.test_gateway_chat import MESSAGES, MODEL, post, served, tiny_path  # noqa: F401


def test_a_bias_of_100_makes_the_model_emit_the_token(served: str,  # noqa: F811
                                                      tiny_path: Path) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    token = 42
    text = AutoTokenizer.from_pretrained(tiny_path).decode([token] * 6)
    answer = sdk(served).completions.create(model=MODEL, prompt="hello redis", max_tokens=6,
                                            logit_bias={str(token): 100})
    assert answer.choices[0].text == text and answer.usage is not None
    assert answer.usage.completion_tokens == 6
    chat = sdk(served).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                               logit_bias={str(token): 250},  # clamped
                                               presence_penalty=0.5, frequency_penalty=0.5)
    assert chat.choices[0].message.content == text


def test_min_tokens_and_penalties_pass_through_the_sdk(served: str) -> None:  # noqa: F811
    client = sdk(served)
    plain = client.completions.create(model=MODEL, prompt="the quick", max_tokens=12)
    penalised = client.completions.create(
        model=MODEL, prompt="the quick", max_tokens=12, frequency_penalty=2.0,
        extra_body={"repetition_penalty": 1.5, "min_tokens": 12})
    assert penalised.usage is not None and penalised.usage.completion_tokens == 12
    assert penalised.choices[0].finish_reason == "length"
    assert plain.choices[0].text != penalised.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # the worker: not in the vocabulary
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -9}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
], ids=["10000-entries", "non-integer-key", "non-number", "out-of-vocab", "presence",
        "frequency", "repetition", "min-negative", "min-above-max"])
def test_bad_values_are_400_naming_the_field(served: str,  # noqa: F811
                                             body: dict[str, Any],
                                             param: str) -> None:
    for route, base in (("completions", {"prompt": "x"}),
                        ("chat/completions", {"messages": MESSAGES})):
        error = assert_openai_error(post(served, route, {"model": MODEL, **base, **body}), 400,
                                    "invalid_request")
        assert error["param"] == param, error
