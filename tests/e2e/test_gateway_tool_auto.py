"""`tool_choice` "auto" (and omitted with `tools`) end to end: the official `openai` client,
the gateway, a real Redis and a worker serving the tiny GPT-2 (random weights: its answers
are random, so the tests hold their SHAPE: text with finish_reason stop or length, or one
valid call of one of the tools), streamed and not. The agent loop's follow-up turn is in
test_gateway_structured.py's conversation test."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tests.e2e.test_gateway import gateway_factory, sdk  # noqa: F401
from tests.e2e.test_gateway_chat import MESSAGES, MODEL, tiny_path  # noqa: F401
from tests.e2e.test_gateway_structured import TOOLS, served  # noqa: F401

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = range(6)


def assert_call(name: str, arguments: str) -> None:
    """A call of one of the tools, its arguments JSON valid against its parameters."""
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def assert_shape(message: Any, reason: str) -> str:
    """"call" or "text", the answer's shape checked."""
    if message.tool_calls:
        assert reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
        assert_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
        return "call"
    assert reason in ("stop", "length") and isinstance(message.content, str)
    assert not message.content.lstrip().startswith("<tool_call>") or reason == "length"
    return "text"


def test_auto_answers_text_or_a_valid_call_streamed_and_not(served: str) -> None:  # noqa: F811
    client, kinds = sdk(served), []
    for seed in SEEDS:
        choice = {} if seed % 2 else {"tool_choice": "auto"}  # omitted: "auto" as well
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 48, "tools": TOOLS,
                "seed": seed, "temperature": 1.0, **choice}
        answer = client.chat.completions.create(**body)
        kinds.append(assert_shape(answer.choices[0].message, answer.choices[0].finish_reason))
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        reason = chunks[-1].choices[0].finish_reason
        if kinds[-1] == "call":  # the call whole in one chunk, no marker text before it
            assert text == "" and len(calls) == 1 and reason == "tool_calls"
            assert calls[0].function and calls[0].function.name and calls[0].function.arguments
            assert_call(calls[0].function.name, calls[0].function.arguments)
        else:
            assert calls == [] and reason in ("stop", "length")
        # the same seed gives the same answer: streamed, it is held and released, not changed
        assert text == (answer.choices[0].message.content or "")
    print("answers:", kinds)
