"""The penalty fields of /v1/chat/completions and /v1/completions, checked (400
`invalid_request` naming the field) and passed on in the worker's names, which are the same
(docs/protocol.md): presence_penalty and frequency_penalty (OpenAI's, -2 to 2),
repetition_penalty (vLLM's, above 0, at most 10), logit_bias (OpenAI's: token id -> bias, at
most 300 entries, each clamped to -100..100) and min_tokens (vLLM's, an integer >= 0, at
most max_tokens). The worker checks the token ids against its vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

from producer.gateway.errors import invalid

PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                  "min_tokens")
# left out of the payload at these values: a request that changes nothing stays as it was
NEUTRAL: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                           "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0}
MAX_LOGIT_BIAS = 300
BIAS_LIMIT = 100.0


def penalty_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The penalty fields present (nulls already dropped), checked; those at their neutral
    value are left out."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if name in fields:
            out[name] = _number(fields[name], name, -2.0, 2.0)
    if "repetition_penalty" in fields:
        out["repetition_penalty"] = _number(fields["repetition_penalty"],
                                            "repetition_penalty", 0.0, 10.0)
        if out["repetition_penalty"] == 0:
            raise invalid("'repetition_penalty' must be above 0", "repetition_penalty")
    if "logit_bias" in fields:
        out["logit_bias"] = logit_bias(fields["logit_bias"])
    if "min_tokens" in fields:
        minimum = fields["min_tokens"]
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise invalid("'min_tokens' must be an integer >= 0", "min_tokens")
        if minimum > fields.get("max_tokens", minimum):
            raise invalid("'min_tokens' must not be above 'max_tokens'", "min_tokens")
        out["min_tokens"] = minimum
    return {name: value for name, value in out.items() if value != NEUTRAL[name]}


def logit_bias(value: Any) -> dict[str, float]:
    """{"<token id>": bias}: at most 300 entries, keys non-negative integers (as strings),
    values numbers, clamped to -100..100."""
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases",
                      "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS}",
                      "logit_bias")
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"'logit_bias' key {str(key)[:20]!r} is not a token id (an integer "
                          ">= 0)", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not math.isfinite(bias):
            raise invalid(f"'logit_bias' value of token {key} must be a number", "logit_bias")
        out[str(int(key))] = max(-BIAS_LIMIT, min(BIAS_LIMIT, float(bias)))
    return out


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not low <= value <= high:
        raise invalid(f"'{name}' must be a number from {low:g} to {high:g}", name)
    return float(value)
