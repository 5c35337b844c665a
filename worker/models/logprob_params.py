"""The `logprobs` field of a generative payload, validated (InvalidInput naming it):

    logprobs (int, 0..20): return each generated token's log probability and this many of
    the most likely alternatives at its position (execution/logprobs.py); null or absent:
    none are returned
"""

from __future__ import annotations

from typing import Any

from worker.models.base import InvalidInput

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (and vLLM's default max_logprobs)


def logprob_fields(payload: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' `logprobs`, by name, when the payload asks for them."""
    value = payload.get("logprobs")
    if value is None:
        return {}
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} (the "
                           f"alternatives returned per token), got {value!r}", "logprobs")
    return {"logprobs": value}
