"""OpenAI's shapes for /v1/chat/completions and /v1/completions on generative models.

Pure: `parse_chat_request` / `parse_completion_request` validate a body (ApiError 400 naming
the field) into a `GenerationRequest` whose `payload` is the worker's generative payload
(docs/protocol.md, "Generative models"); the builders turn the worker's envelopes into
OpenAI's responses and stream chunks. A `null` optional field counts as absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from producer.entry_rules import MAX_STOP_CHARS, MAX_STOP_STRINGS
from producer.gateway.chat_messages import parse_messages
from producer.gateway.choice_fields import parse_n, parse_prompts
from producer.gateway.errors import invalid, refuse_unsupported
from producer.gateway.logprob_shapes import CHAT_LOGPROB_FIELDS, logprob_fields, shaped
from producer.gateway.penalty_fields import PENALTY_FIELDS, penalty_fields
from producer.gateway.structured_fields import STRUCTURED_FIELDS, structured_fields
from producer.gateway.tool_calls import AUTO, NONE, TOOL_FIELDS, tool_call, tool_fields

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                 "stream_options", "n", "user", *PENALTY_FIELDS, *STRUCTURED_FIELDS}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", *CHAT_LOGPROB_FIELDS,
                               *TOOL_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
CHAT, TEXT = "chat", "text"
# The worker's finish_reason -> OpenAI's (stop, length, content_filter, tool_calls): a
# generation cancelled (its client went, or redbatch:cancel:<id> was set) ended early on
# purpose, which the SDKs know as "stop"; anything unknown is "stop" as well.
FINISH_REASONS = {"stop": "stop", "length": "length", "content_filter": "content_filter",
                  "tool_calls": "tool_calls", "cancelled": "stop"}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated body: `kind` is CHAT or TEXT, `payload` what the worker is sent."""

    kind: str
    model: str
    payload: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt (choice_fields.py)
    prompts: tuple[str, ...] = ()  # completions: every prompt (the payload holds the first)
    tool_call: bool = False  # the answer is a tool call (tool_calls.py)
    tool_auto: bool = False  # ... or text: "auto", the call behind its marker (tool_auto.py)

    @property
    def choices(self) -> int:
        return max(1, len(self.prompts)) * self.n


def parse_chat_request(body: Any) -> GenerationRequest:
    fields = _fields(body, CHAT_FIELDS)
    if "max_tokens" in fields and "max_completion_tokens" in fields:
        raise invalid("send one of 'max_tokens' and 'max_completion_tokens'",
                      "max_completion_tokens")
    if "max_completion_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    messages = parse_messages(fields.get("messages"))
    tools, mode = tool_fields(fields, messages)
    return _request(CHAT, fields, {"messages": messages, **tools}, mode)


def parse_completion_request(body: Any) -> GenerationRequest:
    fields = _fields(body, COMPLETION_FIELDS)
    prompts = parse_prompts(fields.get("prompt"))
    request = _request(TEXT, fields, {"prompt": prompts[0]})
    return replace(request, prompts=tuple(prompts)) if len(prompts) > 1 else request


def _fields(body: Any, known: set[str]) -> dict[str, Any]:
    """The body's fields without nulls; 400 for a non-object or an unknown field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    refuse_unsupported(body, known)
    return {key: value for key, value in body.items() if value is not None and key in known}


def _request(kind: str, fields: dict[str, Any], payload: dict[str, Any],
             tool: str = NONE) -> GenerationRequest:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string", "model")
    n = parse_n(fields)
    if not isinstance(fields.get("user", ""), str):
        raise invalid("'user' must be a string", "user")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    payload.update(sampling_fields(fields))
    payload.update(logprob_fields(kind == CHAT, fields))
    if tool == NONE:
        payload.update(structured_fields(fields))
    payload["stream"] = stream
    return GenerationRequest(kind, model, payload, stream, _include_usage(fields, stream), n,
                             tool_call=tool != NONE, tool_auto=tool == AUTO)


def sampling_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """max_tokens, temperature, top_p, seed and stop, checked, in the worker's names."""
    out: dict[str, Any] = {}
    if "max_tokens" in fields:
        if not _is_int(fields["max_tokens"]) or fields["max_tokens"] < 1:
            raise invalid("'max_tokens' must be a positive integer", "max_tokens")
        out["max_new_tokens"] = fields["max_tokens"]
    if "temperature" in fields:
        out["temperature"] = _number(fields["temperature"], "temperature", 0, 2)
    if "top_p" in fields:
        out["top_p"] = _number(fields["top_p"], "top_p", 0, 1)
        if out["top_p"] == 0:
            raise invalid("'top_p' must be above 0", "top_p")
    if "seed" in fields:
        if not _is_int(fields["seed"]):
            raise invalid("'seed' must be an integer", "seed")
        out["seed"] = fields["seed"]
    if "stop" in fields:
        out["stop"] = parse_stop(fields["stop"])
    out.update(penalty_fields(fields))
    return out


def parse_stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(f"a 'stop' string has {max(map(len, stops))} characters; at most "
                      f"{MAX_STOP_CHARS}", "stop")
    return list(stops)


def _include_usage(fields: dict[str, Any], stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise invalid("'stream_options' supports only {\"include_usage\": <bool>}",
                      "stream_options")
    return bool(options.get("include_usage", False))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not low <= value <= high:
        raise invalid(f"'{name}' must be a number from {low:g} to {high:g}", name)
    return float(value)


# --- responses ------------------------------------------------------------------------------


def openai_finish_reason(reason: Any) -> str:
    """One of OpenAI's values for the worker's finish_reason (see FINISH_REASONS)."""
    return FINISH_REASONS.get(reason, "stop") if isinstance(reason, str) else "stop"


def completion_id(kind: str, request_id: str) -> str:
    """The response's id, which names the redbatch request id after its prefix."""
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{request_id}"


def usage(result: dict[str, Any]) -> dict[str, int]:
    """From the worker's result: `prompt_tokens` (0 if it does not say) and `tokens`."""
    prompt, completion = int(result.get("prompt_tokens") or 0), int(result.get("tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _head(request: GenerationRequest, request_id: str, created: int,
          chunk: bool) -> dict[str, Any]:
    kind = request.kind
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == CHAT \
        else "text_completion"
    return {"id": completion_id(kind, request_id), "object": obj, "created": created,
            "model": request.model}


def completion_response(request: GenerationRequest, request_id: str, created: int,
                        result: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer: a chat.completion or a text_completion."""
    text, reason = str(result.get("text", "")), openai_finish_reason(result.get("finish_reason"))
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason,
                              "logprobs": shaped(request.kind == CHAT, result.get("logprobs"))}
    call = tool_call(text, request.tool_auto) if request.tool_call and reason == "stop" \
        else None
    if call is not None:
        choice["finish_reason"] = "tool_calls"
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
    elif request.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {**_head(request, request_id, created, False), "choices": [choice],
            "usage": usage(result)}


def chunk(request: GenerationRequest, request_id: str, created: int, text: str | None,
          finish_reason: str | None = None, first: bool = False,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream chunk: text (None: none, as in the final chunk) and/or finish_reason;
    `logprobs`: its tokens', shaped (logprob_shapes.py)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason,
                              "logprobs": logprobs}
    if request.kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    body = {**_head(request, request_id, created, True), "choices": [choice]}
    if request.include_usage:
        body["usage"] = None  # as OpenAI sends it: only the last chunk's is set
    return body


def usage_chunk(request: GenerationRequest, request_id: str, created: int,
                result: dict[str, Any]) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the usage."""
    return {**_head(request, request_id, created, True), "choices": [],
            "usage": usage(result)}


def tool_call_chunk(request: GenerationRequest, request_id: str, created: int,
                    text: str) -> tuple[dict[str, Any], str] | None:
    """A streamed tool call: the chunk that carries it whole, and its finish_reason (None
    when the text is not a whole call)."""
    call = tool_call(text, request.tool_auto)
    if call is None:
        return None
    body = chunk(request, request_id, created, None)
    body["choices"][0]["delta"]["tool_calls"] = [{"index": 0, **call}]
    return body, "tool_calls"
