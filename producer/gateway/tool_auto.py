"""`tool_choice` "auto" (the default with `tools`): the model decides between text and a call.

The answer is constrained by an llguidance Lark grammar, sent as `structured_outputs.grammar`:
either free text that does not begin with the call marker (Hermes' and Qwen's
`<tool_call>`, after optional whitespace), or the marker, one JSON call matching the anyOf
schema of the tools (Lark's inline `%json`, compact as the worker writes JSON) and
`</tool_call>`, then the end. The gateway reads the answer back (`marked_call`): a whole
call behind the marker is a call, anything else is text. Streamed, `MarkerHold` keeps back
the deltas while the text may still become the marker, so no part of a call leaks as text.
"""

from __future__ import annotations

import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
LEAD = " \t\n"  # whitespace the model may write before the marker
# JSON as the worker's json kind writes it (worker/models/structured_params.py COMPACT): no
# free whitespace, which a weak model can emit forever
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR = """start: TEXT | OPEN call CLOSE
OPEN: /[ \\t\\n]*<tool_call>\\n?/
CLOSE: /\\n?<\\/tool_call>/
TEXT: /(?s:.*)/ & ~/[ \\t\\n]*<tool_call>(?s:.*)/
call: %json """
TEXT, CALL, OPEN_ = "text", "call", "open"  # what an answer's beginning makes it


def auto_grammar(schema: dict[str, Any]) -> str:
    """The Lark grammar of an answer that is text or one marked call matching `schema`."""
    return GRAMMAR + json.dumps({**schema, "x-guidance": COMPACT})


def described(listed: str) -> str:
    """The system message's words for "auto": how to call, and that text is allowed."""
    return ("You may call one of these functions. To call one, answer with only "
            f"{OPEN}{{\"name\": <function name>, \"arguments\": <its arguments as JSON>}}"
            f"{CLOSE}. Otherwise answer in plain text. The functions: {listed}")


def marked_call(text: str) -> str | None:
    """The call's JSON text when `text` is a whole marked call, else None."""
    body = text.lstrip(LEAD)
    if not body.startswith(OPEN):
        return None
    body = body[len(OPEN):].rstrip(LEAD)
    return body[:-len(CLOSE)].strip(LEAD) if body.endswith(CLOSE) else None


def state(text: str) -> str:
    """CALL once the text begins with the marker, OPEN_ while it may still, else TEXT."""
    body = text.lstrip(LEAD)
    if body.startswith(OPEN):
        return CALL
    return OPEN_ if OPEN.startswith(body) else TEXT


class MarkerHold:
    """A streamed "auto" answer's deltas, kept back while it may still become a call."""

    def __init__(self) -> None:
        self.text, self.kind = "", OPEN_
        self.held: list[dict[str, Any]] = []

    def take(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The deltas to send now: none while the answer may be a call, else all held."""
        self.held.append(delta)
        if self.kind == OPEN_:  # decided once: text or a call stays so, whatever follows
            self.text += str(delta.get("text", ""))
            self.kind = state(self.text)
        if self.kind != TEXT:
            return []
        released, self.held = self.held, []
        return released

    def is_call(self) -> bool:
        """Whether the answer so far began a call (sent whole, or as text if cut, at the end)."""
        return self.kind == CALL

    def flush(self) -> list[dict[str, Any]]:
        """At the end, the deltas still held of an answer that is not a call."""
        released, self.held = ([], self.held) if self.is_call() else (self.held, [])
        return released
