"""The gateway's structured-output and tool fields (structured_fields.py, tool_calls.py):
the tool-choice schema builder, the payload the worker is sent, the tool_calls answer, and
each mistake a 400 naming its field. Pure: no server."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from producer.gateway.errors import ApiError
from producer.gateway.generation_shapes import (
    completion_response,
    parse_chat_request,
    parse_completion_request,
    tool_call_chunk,
)
from producer.gateway.structured_fields import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "add 2 and 3"}]}


def test_required_is_an_any_of_over_the_tools_calls() -> None:
    request = parse_chat_request({**CHAT, "tools": TOOLS, "tool_choice": "required"})
    schema = request.payload["structured_outputs"]["json"]
    assert request.tool_call and [s["properties"]["name"] for s in schema["anyOf"]] == [
        {"const": "add"}, {"const": "now"}]
    jsonschema.validate({"name": "add", "arguments": {"a": 2, "b": 3}}, schema)
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    for wrong in ({"name": "sub", "arguments": {}}, {"name": "add", "arguments": {"a": 2}},
                  {"name": "add"}, {"name": "now", "arguments": {}, "x": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    system, user = request.payload["messages"]
    assert system["content"].startswith("be brief\n\n") and '"name": "add"' in system["content"]
    assert user == CHAT["messages"][1]
    alone = parse_chat_request({**CHAT, "messages": [user], "tools": TOOLS,
                                "tool_choice": "required"}).payload["messages"]
    assert [m["role"] for m in alone] == ["system", "user"] and '"now"' in alone[0]["content"]


def test_a_named_function_is_its_one_call_and_none_ignores_the_tools() -> None:
    named = parse_chat_request({**CHAT, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "now"}}})
    schema = named.payload["structured_outputs"]["json"]
    assert schema["properties"]["name"] == {"const": "now"} and "anyOf" not in schema
    plain = parse_chat_request({**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert not plain.tool_call and "structured_outputs" not in plain.payload
    assert plain.payload["messages"] == CHAT["messages"]


def test_a_tool_answer_is_openais_tool_calls() -> None:
    request = parse_chat_request({**CHAT, "tools": TOOLS, "tool_choice": "required"})
    text = json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})
    answer = completion_response(request, "r1", 0, {"text": text, "finish_reason": "stop"})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    cut = completion_response(request, "r1", 0, {"text": text[:9], "finish_reason": "length"})
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == text[:9]
    streamed = tool_call_chunk(request, "r1", 0, text)
    assert streamed is not None and streamed[1] == "tool_calls"
    assert streamed[0]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert tool_call_chunk(request, "r1", 0, text[:9]) is None


def test_structured_fields_pass_on_in_the_workers_names() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": ADD}}
    chat = parse_chat_request({**CHAT, "response_format": schema})
    assert chat.payload["response_format"] == schema and not chat.tool_call
    text = parse_completion_request({"model": "m", "prompt": "x", "structured_outputs": {
        "regex": "[0-9]+"}})
    assert text.payload["structured_outputs"] == {"regex": "[0-9]+"}
    plain = parse_chat_request({**CHAT, "response_format": {"type": "text"}})
    assert "response_format" not in plain.payload


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": ADD}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a" * MAX_GRAMMAR_CHARS}}, "structured_outputs"),
    ({"structured_outputs": {"json": deep(MAX_SCHEMA_DEPTH + 2)}}, "structured_outputs"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
], ids=["type", "no-name", "both", "empty-regex", "choice-string", "too-long", "too-deep",
        "auto-and-format", "no-tools", "unknown-tool", "not-function", "tools-and-format"])
def test_mistakes_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_chat_request({**CHAT, **body})
    assert refused.value.status == 400 and refused.value.param == param
