"""The penalty fields of a generative payload, validated (InvalidInput naming the field):

    presence_penalty, frequency_penalty (numbers in [-2, 2], default 0: over output tokens),
    repetition_penalty (a number in (0, 10], default 1: over prompt and output tokens),
    logit_bias ({"<token id>": number}, at most 300 entries, each bias clamped to
    [-100, 100]), min_tokens (int >= 0, default 0: EOS blocked until that many tokens)

execution/penalties.py applies them on the device, for a whole batch at once.
"""

from __future__ import annotations

import math
from typing import Any

from worker.models.base import InvalidInput

MAX_LOGIT_BIAS = 300  # as OpenAI
BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0
REPETITION_LIMIT = 10.0


def _number(payload: dict[str, Any], name: str, default: float, low: float,
            high: float, open_low: bool = False) -> float:
    value = payload.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < low or value > high or (open_low and value == low):
        bound = "(" if open_low else "["
        raise InvalidInput(f"'{name}' must be a number in {bound}{low:g}, {high:g}], got "
                           f"{value!r}", name)
    return float(value)


def logit_bias(value: Any, vocab: int | None = None) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias} as sorted (id, bias) pairs, each bias clamped to +-100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidInput("'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidInput(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS}",
                           "logit_bias")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None or (vocab is not None and token >= vocab):
            raise InvalidInput(f"'logit_bias' key {key!r} is not a token id of this model "
                               f"(an integer from 0 to {vocab - 1 if vocab else 'the vocab'})",
                               "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not math.isfinite(bias):
            raise InvalidInput(f"'logit_bias' value of {key!r} must be a number, got {bias!r}",
                               "logit_bias")
        pairs[token] = max(-BIAS_LIMIT, min(BIAS_LIMIT, float(bias)))
    return tuple(sorted(pairs.items()))


def _token_id(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return None


def penalty_fields(payload: dict[str, Any], max_new: int, vocab: int | None) -> dict[str, Any]:
    """SamplingParams' penalty fields, by name (only those the payload sets)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if payload.get(name) is not None:
            out[name] = _number(payload, name, 0.0, -PENALTY_LIMIT, PENALTY_LIMIT)
    if payload.get("repetition_penalty") is not None:
        out["repetition_penalty"] = _number(payload, "repetition_penalty", 1.0, 0.0,
                                            REPETITION_LIMIT, open_low=True)
    if payload.get("logit_bias") is not None:
        out["logit_bias"] = logit_bias(payload["logit_bias"], vocab)
    minimum = payload.get("min_tokens")
    if minimum is not None:
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
            raise InvalidInput(f"'min_tokens' must be an integer >= 0, got {minimum!r}",
                               "min_tokens")
        out["min_tokens"] = min(minimum, max_new)
    return out
