"""Tool calling on /v1/chat/completions, enforced by a grammar.

`tools` with `tool_choice` "required" or a named function become a JSON-schema constraint
on the answer ({"name": <a tool's name>, "arguments": <its parameters' schema>}; "required"
is an anyOf over the tools), sent to the worker as `structured_outputs.json`, with the tools
described in the system message (a chat template without a tool format, as SmolLM2's, would
not show them to the model). The answer is one call, shaped as OpenAI's `message.tool_calls`
with finish_reason "tool_calls"; streamed, the call comes in one chunk when it is complete.
`tool_choice` "auto", the default when tools are given, lets the model choose: its answer is
text, or one call behind the `<tool_call>` marker that an llguidance Lark grammar
(`structured_outputs.grammar`) holds to the tools' anyOf schema (tool_auto.py); a whole
call is answered as above, anything else as text. "none" is plain generation (the tools are
ignored). `parallel_tool_calls` is accepted; one call is made.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from producer.gateway import jsonio, tool_auto
from producer.gateway.errors import invalid
from producer.gateway.structured_fields import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH, depth

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MAX_TOOLS = 128
ANY_ARGUMENTS = {"type": "object"}
NONE, FORCED, AUTO = "", "forced", "auto"  # how the answer may hold a call


def tool_fields(fields: dict[str, Any], messages: list[dict[str, Any]]
                ) -> tuple[dict[str, Any], str]:
    """The worker's payload fields for tools (none for "none" or no tools) and the mode
    (NONE, FORCED or AUTO); `messages` get the tools' description. 400 for malformed tools."""
    tools, choice = fields.get("tools"), fields.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return {}, NONE
    functions = _functions(tools)
    if choice == "none":
        return {}, NONE
    if any(name in fields for name in ("response_format", "structured_outputs")):
        raise invalid("send 'tools' (unless 'tool_choice' is \"none\") or a structured "
                      "output, not both", "tool_choice")
    auto = choice in (None, "auto")
    chosen = functions if auto else _chosen(choice, functions)
    schema = {"anyOf": [_call_schema(f) for f in chosen]} if len(chosen) > 1 \
        else _call_schema(chosen[0])
    if depth(schema) > MAX_SCHEMA_DEPTH:  # first: too deep to write as JSON text
        raise invalid(f"'tools' nest deeper than {MAX_SCHEMA_DEPTH} levels", "tools")
    grammar = tool_auto.auto_grammar(schema) if auto else None
    if len(grammar or jsonio.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'tools' make a grammar over {MAX_GRAMMAR_CHARS} bytes", "tools")
    listed = _listed(chosen)
    _describe(messages, tool_auto.described(listed) if auto else _described(listed))
    return ({"structured_outputs": {"grammar": grammar}}, AUTO) if auto else \
        ({"structured_outputs": {"json": schema}}, FORCED)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    functions = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"'tools[{index}]' must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": <string>, \"parameters\": <JSON schema>}}", "tools")
        functions.append(function)
    return functions


def _chosen(choice: Any, functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if choice == "required":
        return functions
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise invalid("'tool_choice' must be \"none\", \"required\" or {\"type\": "
                      "\"function\", \"function\": {\"name\": <one of the tools>}}",
                      "tool_choice")
    return named[:1]


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One call of `function`: {"name": its name, "arguments": its parameters}."""
    return {"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or ANY_ARGUMENTS},
        "required": ["name", "arguments"], "additionalProperties": False}


def _describe(messages: list[dict[str, Any]], description: str) -> None:
    """The tools' description at the end of the first system message, or in a new one
    first (a chat template may refuse two system messages in a row)."""
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{description}"}
    else:
        messages.insert(0, {"role": "system", "content": description})


def _listed(functions: list[dict[str, Any]]) -> str:
    return json.dumps([{key: f[key] for key in ("name", "description", "parameters")
                        if key in f} for f in functions])


def _described(listed: str) -> str:
    return ("Answer with one function call as JSON: {\"name\": <function name>, "
            f"\"arguments\": <its arguments>}}. The functions: {listed}")


def tool_call(text: str, marked: bool = False) -> dict[str, Any] | None:
    """The call a constrained answer holds, as OpenAI's tool_calls entry (None when the text
    is not a whole call: max_tokens cut it, or an "auto" answer (`marked`) is text)."""
    body = tool_auto.marked_call(text) if marked else text
    if body is None:
        return None
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(call.get("arguments", {}))}}
