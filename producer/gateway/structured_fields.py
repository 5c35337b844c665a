"""Structured outputs on /v1/chat/completions and /v1/completions, checked where it is cheap
(400 `invalid_request` naming the field) and passed on in the worker's names, which are the
same (docs/protocol.md): OpenAI's `response_format` ({"type": "text"}, {"type":
"json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) and
vLLM's `structured_outputs` (one of json, json_object, regex, choice, grammar as Lark).

The gateway checks the shape, the size (MAX_GRAMMAR_CHARS of JSON text, the worker's limit)
and the nesting (MAX_SCHEMA_DEPTH); the worker compiles the grammar with llguidance and
answers `invalid_request` for one it refuses (a regex that explodes, a Lark grammar with a
mistake), which the client receives as a 400 as well.
"""

from __future__ import annotations

from typing import Any

from producer.gateway import jsonio
from producer.gateway.errors import invalid

STRUCTURED_FIELDS = ("response_format", "structured_outputs")
MAX_GRAMMAR_CHARS = 100_000  # the worker's (worker/models/structured_params.py)
MAX_SCHEMA_DEPTH = 64
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def structured_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The structured-output field present (nulls already dropped), checked; a
    response_format of type text is left out (it asks for nothing)."""
    given = [name for name in STRUCTURED_FIELDS if name in fields]
    if len(given) > 1:
        raise invalid("send 'response_format' or 'structured_outputs', not both",
                      "structured_outputs")
    if not given:
        return {}
    name, value = given[0], fields[given[0]]
    if name == "response_format":
        _response_format(value)
        if value["type"] == "text":
            return {}
    else:
        _structured_outputs(value)
    _size(value, name)
    return {name: value}


def _response_format(value: Any) -> None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                      "response_format")
    if kind != "json_schema":
        return
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) \
            or not isinstance(inner.get("schema", {}), dict):
        raise invalid("'response_format.json_schema' must be an object with a 'name' (a "
                      "string) and a 'schema' (an object)", "response_format")


def _structured_outputs(value: Any) -> None:
    given = [k for k in KINDS if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or len(given) != 1 or set(value) - set(KINDS):
        raise invalid(f"'structured_outputs' must hold exactly one of {', '.join(KINDS)}",
                      "structured_outputs")
    body = value[given[0]]
    if given[0] in ("regex", "grammar") and not (isinstance(body, str) and body):
        raise invalid(f"'structured_outputs.{given[0]}' must be a non-empty string",
                      "structured_outputs")
    if given[0] == "choice" and not (isinstance(body, list) and body and all(
            isinstance(c, str) and c for c in body)):
        raise invalid("'structured_outputs.choice' must be a list of non-empty strings",
                      "structured_outputs")


def _size(value: Any, name: str) -> None:
    """Refuse a grammar past the worker's limits before it is sent: the size first (in C),
    so the walk for the depth is over at most MAX_GRAMMAR_CHARS of JSON."""
    chars = len(jsonio.dumps(value))
    if chars > MAX_GRAMMAR_CHARS:
        raise invalid(f"'{name}' is {chars} bytes of JSON; at most {MAX_GRAMMAR_CHARS}", name)
    if depth(value) > MAX_SCHEMA_DEPTH + 2:  # the schema's levels and its two wrappers
        raise invalid(f"'{name}' nests deeper than {MAX_SCHEMA_DEPTH} levels", name)


def depth(value: Any) -> int:
    """How deep objects and lists nest in `value` (stops past the limit), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list) and level <= MAX_SCHEMA_DEPTH + 3:
            deepest = max(deepest, level)
            stack += [(child, level + 1) for child in
                      (item.values() if isinstance(item, dict) else item)]
    return deepest
