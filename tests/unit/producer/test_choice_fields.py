"""n and lists of prompts on the gateway (producer/gateway/choice_fields.py): the choices'
payloads in OpenAI's order (prompt-major) with seed + j, and the limits."""

from __future__ import annotations

import pytest

from producer.gateway.choice_fields import check_choices, choice_payloads
from producer.gateway.errors import ApiError
from producer.gateway.generation_shapes import parse_chat_request, parse_completion_request


def test_a_list_of_prompts_with_n_makes_prompt_major_payloads_with_seed_plus_j() -> None:
    parsed = parse_completion_request({"model": "lm", "prompt": ["a", "b"], "n": 2,
                                       "seed": 7, "max_tokens": 3})
    assert parsed.choices == 4 and parsed.prompts == ("a", "b")
    payloads = choice_payloads(parsed.payload, list(parsed.prompts), parsed.n)
    assert [(p["prompt"], p["seed"]) for p in payloads] == [("a", 7), ("a", 8), ("b", 7),
                                                            ("b", 8)]
    assert all(p["max_new_tokens"] == 3 for p in payloads)


def test_chat_n_without_a_seed_sends_no_seed() -> None:
    parsed = parse_chat_request({"model": "lm", "messages": [{"role": "user",
                                                             "content": "hi"}], "n": 3})
    payloads = choice_payloads(parsed.payload, None, parsed.n)
    assert len(payloads) == 3 and all("seed" not in p and "prompt" not in p for p in payloads)


def test_choices_past_max_choices_are_400_naming_the_field() -> None:
    check_choices(2, 8, 16)
    for prompts, n, field in ((1, 17, "n"), (20, 1, "prompt"), (4, 5, "n")):
        with pytest.raises(ApiError) as raised:
            check_choices(prompts, n, 16)
        assert raised.value.status == 400 and raised.value.param == field
