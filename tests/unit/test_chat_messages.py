"""The conversation after a tool call (worker/models/chat_messages.py): checked, given as it
is to a chat template that speaks tools (arguments as an object), and as the documented
plain text to one that does not; the gateway's parse of the same messages."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2 import Template

from producer.gateway.chat_messages import parse_messages
from producer.gateway.errors import ApiError
from worker.models.base import InvalidInput
from worker.models.chat_messages import checked_messages, for_template

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AFTER_CALL: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
TOOLS = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] "
         "%}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}\n{% endfor %}")


def rendered(template: str, payload_messages: list[dict[str, Any]]) -> str:
    messages = for_template(checked_messages(payload_messages), template)
    return Template(template).render(messages=messages)


def test_a_template_without_tools_gets_the_plain_text_form() -> None:
    assert rendered(PLAIN, AFTER_CALL) == (
        "<user>Weather in Paris?\n"
        '<assistant><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n'
        "<user>Result of get_weather (call_1):\n18 C, sunny\n")


def test_a_template_that_speaks_tools_gets_the_calls_with_their_arguments() -> None:
    assert rendered(TOOLS, AFTER_CALL) == ("<user>Weather in Paris?\n<assistant>"
                                           "[get_weather Paris]\n<tool>18 C, sunny\n")


def test_messages_without_tools_are_unchanged() -> None:
    plain = [{"role": "user", "content": "hi"}]
    assert for_template(checked_messages(plain), PLAIN) == plain


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None},
    {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
    {"role": "tool", "tool_call_id": 3, "content": "x"},
])
def test_the_worker_refuses_malformed_tool_messages(message: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput) as refused:
        checked_messages([message])
    assert refused.value.details["field"] == "messages"


def test_the_gateway_passes_the_conversation_after_a_call_on() -> None:
    parsed = parse_messages([*AFTER_CALL[:2], {**AFTER_CALL[2], "name": "get_weather"}])
    assert parsed == [AFTER_CALL[0], {"role": "assistant", "content": "", "tool_calls": [CALL]},
                      AFTER_CALL[2]]


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "x"},  # no tool_call_id
    {"role": "user", "content": "x", "tool_call_id": "c"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]},
    {"role": "assistant", "content": None},
])
def test_the_gateway_refuses_malformed_tool_messages(message: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as refused:
        parse_messages([message])
    assert refused.value.param == "messages"
