"""The chat messages of a generative payload: checked, and shaped for the chat template.

Each is {"role": str, "content": str}. The conversation after a tool call may carry an
assistant message with "tool_calls" (OpenAI's entries: {"id", "type": "function",
"function": {"name", "arguments": <JSON text>}}; its content then may be null) and a
{"role": "tool", "tool_call_id", "content"} message with a call's result. A chat template
that speaks tools (its text uses `tool_calls`) gets them as Hugging Face's templates expect
(arguments as an object). Any other gets this plain-text form (docs/protocol.md):

    assistant: its content, then each call on a line of its own as
        <tool_call>{"name": ..., "arguments": ...}</tool_call> (the form a `tool_choice`
        "auto" answer takes, producer/gateway/tool_auto.py: a model shown its earlier calls
        so answers the next one so)
    tool: a user message "Result of <the call's function> (<tool_call_id>):\n<content>"
"""

from __future__ import annotations

import json
from typing import Any

from worker.models.base import InvalidInput

SHAPE = "messages[{}] must be {{\"role\": <string>, \"content\": <string>}}"


def checked_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages, each checked: role and content strings, tool calls and ids in shape."""
    return [_checked(message, index) for index, message in enumerate(messages)]


def _checked(message: Any, index: int) -> dict[str, Any]:
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise InvalidInput(SHAPE.format(index), "messages")
    calls = message.get("tool_calls")
    content = "" if calls is not None and message.get("content") is None \
        else message.get("content")
    if not isinstance(content, str):
        raise InvalidInput(SHAPE.format(index), "messages")
    checked: dict[str, Any] = {"role": message["role"], "content": content}
    if calls is not None:
        checked["tool_calls"] = [_call(call, index) for call in _listed(calls, index)]
    if message.get("tool_call_id") is not None:
        if not isinstance(message["tool_call_id"], str):
            raise InvalidInput(f"messages[{index}].tool_call_id must be a string", "messages")
        checked["tool_call_id"] = message["tool_call_id"]
    return checked


def _listed(calls: Any, index: int) -> list[Any]:
    if not isinstance(calls, list) or not calls:
        raise InvalidInput(f"messages[{index}].tool_calls must be a non-empty list",
                           "messages")
    return calls


def _call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)):
        raise InvalidInput(f"messages[{index}].tool_calls entries must be {{\"id\", "
                           "\"function\": {\"name\", \"arguments\": <JSON text>}}", "messages")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def speaks_tools(template: str) -> bool:
    """Whether a chat template renders tool calls itself (Hugging Face's convention)."""
    return "tool_calls" in template


def for_template(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """The messages as the chat template is given them."""
    if not any("tool_calls" in m or m["role"] == "tool" for m in messages):
        return messages
    if speaks_tools(template):
        return [_with_objects(m) if "tool_calls" in m else m for m in messages]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    return [_plain(m, names) for m in messages]


def _with_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's templates take a call's arguments as an object, not JSON text."""
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _plain(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A tool-call message as plain text for a template without a tool format."""
    if message["role"] == "tool":
        call_id = message.get("tool_call_id", "")
        return {"role": "user", "content": f"Result of {names.get(call_id, 'a tool')} "
                                           f"({call_id}):\n{message['content']}"}
    if "tool_calls" not in message:
        return message
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c)}
             for c in message["tool_calls"]]
    lines = [f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls]
    text = "\n".join(([message["content"]] if message["content"] else []) + lines)
    return {"role": message["role"], "content": text}


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as JSON values (their text where it is not JSON)."""
    try:
        return json.loads(call["function"]["arguments"])
    except ValueError:
        return call["function"]["arguments"]
