"""The `messages` of /v1/chat/completions, checked into the worker's messages (docs/protocol.md).

A message is {"role", "content"} (content a string or a list of text parts, joined; `name`
accepted and ignored). The conversation after a tool call is accepted too: an assistant
message with `tool_calls` (its `content` may be null) and a `role: "tool"` message with the
`tool_call_id` it answers; the worker renders them through the model's chat template, or as
plain text where the template has no tool format (worker/models/chat_messages.py).
"""

from __future__ import annotations

from typing import Any

from producer.gateway.errors import invalid

MESSAGE_FIELDS = {"role", "content", "name"}
ROLES = {"system": "system", "developer": "system", "user": "user",
         "assistant": "assistant", "tool": "tool"}  # OpenAI's "developer" is a system message
MAX_ID_CHARS = 200


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The worker's messages: {"role", "content"}, with "tool_calls" on an assistant
    message that made calls and "tool_call_id" on a tool message."""
    if not isinstance(value, list) or not value:
        raise invalid("'messages' is required: a non-empty list of messages", "messages")
    return [_message(message, index) for index, message in enumerate(value)]


def _message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(f"'messages[{index}]' must be an object with a string 'role'",
                      "messages")
    # a null key counts as absent (the SDKs send an answer's message back with refusal: null)
    message = {k: v for k, v in message.items() if v is not None or k == "content"}
    role = message["role"]
    if role not in ROLES:
        raise invalid(f"'messages[{index}].role' must be one of {sorted(ROLES)}, got "
                      f"{role!r}", "messages")
    own = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
    extra = sorted(set(message) - MESSAGE_FIELDS - own)
    if extra:
        raise invalid(f"'messages[{index}].{extra[0]}' is not supported", "messages",
                      "unsupported_parameter")
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None:
        content = "" if message.get("content") is None else _content(message["content"], index)
        return {"role": role, "content": content, "tool_calls": _calls(calls, index)}
    parsed = {"role": ROLES[role], "content": _content(message.get("content"), index)}
    if role == "tool":
        parsed["tool_call_id"] = _id(message.get("tool_call_id"),
                                     f"messages[{index}].tool_call_id")
    return parsed


def _calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries: {"id", "type": "function", "function": {"name",
    "arguments" (a JSON string)}}, as the answer gave them."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise invalid(f"'{where}' must be a non-empty list of calls", "messages")
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise invalid(f"'{where}' entries must be {{\"id\", \"type\": \"function\", "
                          "\"function\": {\"name\", \"arguments\"}}", "messages")
        checked.append({"id": _id(call.get("id"), f"{where}.id"), "type": "function",
                        "function": {"name": function["name"],
                                     "arguments": function["arguments"]}})
    return checked


def _id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise invalid(f"'{where}' must be a string of 1 to {MAX_ID_CHARS} characters",
                      "messages")
    return value


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(part["text"] for part in content)
    raise invalid(f"'messages[{index}].content' must be a string or a list of text parts",
                  "messages")
