"""The structured-output fields of a generative payload, validated (InvalidInput naming the
field) into one `Constraint`, which pipeline/grammars.py compiles with llguidance:

    response_format: {"type": "text"} (none), {"type": "json_object"} (any JSON object) or
        {"type": "json_schema", "json_schema": {"name": str, "schema": {...}, "strict": bool}}
    structured_outputs (vLLM's): exactly one of {"json": <schema object or its JSON text>},
        {"json_object": true}, {"regex": str}, {"choice": [str, ...]} or {"grammar": <Lark>}

One of the two at most. A grammar's text is at most MAX_GRAMMAR_CHARS characters and a
schema nests at most MAX_SCHEMA_DEPTH levels: both checked here, before any compile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from worker.models.base import InvalidInput

MAX_GRAMMAR_CHARS = 100_000  # a schema's JSON text, a regex or a Lark grammar
MAX_SCHEMA_DEPTH = 64  # objects and lists nested in a schema
MAX_CHOICES = 1_000
KINDS = ("json", "json_object", "regex", "choice", "grammar")
ANY_OBJECT = '{"type": "object"}'
# JSON as OpenAI writes it ({"a": 1, "b": [2, 3]}): no free whitespace, which a weak model
# can emit forever; a schema may ask for it with "x-guidance": {"whitespace_flexible": true}
COMPACT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                           "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's answer must match: `kind` (json, regex, choice or lark), `source`
    (the schema's JSON text, the regex, the choices' JSON list or the Lark grammar) and
    `field`, the payload key it came from (errors name it)."""

    field: str
    kind: str
    source: str

    def grammar(self) -> str:
        """The llguidance grammar (ValueError for a schema it cannot read)."""
        from llguidance import LLMatcher

        if self.kind == "json":
            return str(LLMatcher.grammar_from_json_schema(
                self.source, defaults=COMPACT))  # type: ignore[arg-type]
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.source))
        if self.kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(self.source))
            return str(LLMatcher.grammar_from_lark(lark))
        return str(LLMatcher.grammar_from_lark(self.source))


def constraint_of(payload: dict[str, Any]) -> Constraint | None:
    """The payload's constraint, or None when it asks for none."""
    response_format = payload.get("response_format")
    structured = payload.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise InvalidInput("give 'response_format' or 'structured_outputs', not both",
                           "structured_outputs")
    if response_format is not None:
        return _response_format(response_format)
    if structured is not None:
        return _structured_outputs(structured)
    return None


def _response_format(value: Any) -> Constraint | None:
    name = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(name, "json", ANY_OBJECT)
    if kind != "json_schema":
        raise InvalidInput("'response_format' must be {\"type\": \"text\"}, {\"type\": "
                           "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                           "{\"name\": ..., \"schema\": {...}}}", name)
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
        raise InvalidInput("'response_format.json_schema' must be an object with a "
                           "'schema' object", name)
    return Constraint(name, "json", schema_text(inner.get("schema", {}), name))


def _structured_outputs(value: Any) -> Constraint:
    name = "structured_outputs"
    given = [k for k in KINDS if isinstance(value, dict) and value.get(k) is not None]
    if not isinstance(value, dict) or len(given) != 1 or set(value) - set(KINDS):
        raise InvalidInput("'structured_outputs' must hold exactly one of "
                           f"{', '.join(KINDS)}", name)
    kind, body = given[0], value[given[0]]
    if kind == "json_object":
        return Constraint(name, "json", ANY_OBJECT)
    if kind == "json":
        if isinstance(body, str):
            body = _loaded(body, name)
        if not isinstance(body, dict):
            raise InvalidInput("'structured_outputs.json' must be a JSON schema object", name)
        return Constraint(name, "json", schema_text(body, name))
    if kind == "choice":
        if not isinstance(body, list) or not body or len(body) > MAX_CHOICES \
                or not all(isinstance(c, str) and c for c in body):
            raise InvalidInput("'structured_outputs.choice' must be a list of 1 to "
                               f"{MAX_CHOICES} non-empty strings", name)
        return Constraint(name, "choice", _sized(json.dumps(body), name))
    if not isinstance(body, str) or not body:
        raise InvalidInput(f"'structured_outputs.{kind}' must be a non-empty string", name)
    return Constraint(name, "regex" if kind == "regex" else "lark", _sized(body, name))


def _loaded(text: str, name: str) -> Any:
    try:
        return json.loads(_sized(text, name))
    except (ValueError, RecursionError):
        raise InvalidInput(f"'{name}' schema is not valid JSON", name) from None


def schema_text(schema: dict[str, Any], name: str) -> str:
    """The schema as JSON text, its depth and size checked (deepest first: a schema too
    deep to serialise is refused before the attempt)."""
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidInput(f"'{name}' schema nests deeper than {MAX_SCHEMA_DEPTH} levels",
                           name)
    return _sized(json.dumps(schema, separators=(",", ":")), name)


def _sized(text: str, name: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidInput(f"'{name}' is {len(text)} characters; at most "
                           f"{MAX_GRAMMAR_CHARS}", name)
    return text


def depth(value: Any) -> int:
    """How deep objects and lists nest in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_SCHEMA_DEPTH:
                break
            children = item.values() if isinstance(item, dict) else item
            stack += [(child, level + 1) for child in children]
    return deepest
