"""`logprobs` on /v1/chat/completions and /v1/completions: the request fields, checked (400
`invalid_request` naming the field), and the worker's per-token records in OpenAI's shapes.

Requests: chat's `logprobs` (a boolean) and `top_logprobs` (0..20, only with logprobs
true); completions' `logprobs` (an integer, 0..20: OpenAI allows 5, vLLM 20). Both become
the worker's payload `logprobs`: how many alternatives per token (docs/protocol.md).

Responses: the worker sends, per token of the answer's text (an EOS token has none),
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}: chat's
`choices[].logprobs.content[]` as it is; completions' `choices[].logprobs` as the four
lists {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}, text_offset
counted from the start of the answer (no echo of the prompt).
"""

from __future__ import annotations

from typing import Any

from producer.gateway.errors import invalid

MAX_TOP_LOGPROBS = 20
CHAT_LOGPROB_FIELDS = ("logprobs", "top_logprobs")
Records = list[dict[str, Any]]


def logprob_fields(chat: bool, fields: dict[str, Any]) -> dict[str, Any]:
    """The worker's `logprobs` (alternatives per token), or nothing when not asked for."""
    if chat:
        wanted = fields.get("logprobs", False)
        if not isinstance(wanted, bool):
            raise invalid("'logprobs' must be a boolean", "logprobs")
        top = _count(fields.get("top_logprobs", 0), "top_logprobs")
        if "top_logprobs" in fields and not wanted:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return {"logprobs": top} if wanted else {}
    if "logprobs" not in fields:
        return {}
    return {"logprobs": _count(fields["logprobs"], "logprobs")}


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"'{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return value


def shaped(chat: bool, records: Records | None, offset: int = 0) -> dict[str, Any] | None:
    """A choice's `logprobs`: None when not asked for; `offset`: where the records' text
    starts in the answer (a stream's later chunks)."""
    if records is None:
        return None
    if chat:
        return {"content": records, "refusal": None}
    offsets = []
    for record in records:
        offsets.append(offset)
        offset += len(record["token"])
    return {"tokens": [r["token"] for r in records],
            "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{t["token"]: t["logprob"] for t in r["top_logprobs"]}
                             for r in records],
            "text_offset": offsets}


def text_length(records: Records | None) -> int:
    """How far the records' tokens move text_offset."""
    return sum(len(r["token"]) for r in records or [])
