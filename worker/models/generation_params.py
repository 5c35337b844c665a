"""The request payload of a generative model, validated: each mistake is a clear
InvalidInput (answered `invalid_request`), never a failure of the worker.

    {"prompt": str} or {"messages": [{"role": str, "content": str}, ...]} (tool calls and
        results too: models/chat_messages.py)
    max_new_tokens (int, 1..max_new_tokens_limit), temperature (>= 0; 0 = greedy),
    top_p (0 < p <= 1), top_k (int >= 0; 0 = off), seed (int), stop (<= 4 strings of
    <= 1,000 characters), stream (bool, default true), presence_penalty,
    frequency_penalty, repetition_penalty, logit_bias, min_tokens (models/penalty_params.py);
    logprobs (int 0..20, models/logprob_params.py); response_format, structured_outputs
    (models/structured_params.py); a key set to null counts as left out
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from producer.entry_rules import MAX_STOP_CHARS, MAX_STOP_STRINGS
from worker.models.base import InvalidInput
from worker.models.chat_messages import checked_messages
from worker.models.logprob_params import logprob_fields
from worker.models.penalty_params import penalty_fields
from worker.models.structured_params import Constraint, constraint_of

SHAPE = "payload must be an object with 'prompt' (a string) or 'messages' (a list of " \
        "{\"role\": <string>, \"content\": <string>})"
# top_k past any vocabulary keeps every token, as 0 does; capped, it fits the sampler's int64
TOP_K_CAP = 1 << 31


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request chooses its tokens (execution/sampling.py draws them)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0  # these five: models/penalty_params.py
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token, with its logprob (None: off)
    constraint: Constraint | None = None  # a grammar its tokens must match (llguidance)

    @property
    def penalised(self) -> bool:
        """Whether the logits are changed before the draw (execution/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)


@dataclass(frozen=True, slots=True)
class GenerationInput:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    redelivered: bool = False  # read before (claimed, or our own after a restart): may resume
    fork_of: str | None = None  # a request of the same prompt it may share KV blocks with


def prompt_of(payload: Any) -> str | list[dict[str, Any]]:
    """The prompt string or the chat messages, checked for shape."""
    if not isinstance(payload, dict):
        raise InvalidInput(SHAPE)
    if "prompt" in payload and "messages" in payload:
        raise InvalidInput("give 'prompt' or 'messages', not both", "messages")
    if "prompt" in payload:
        if not isinstance(payload["prompt"], str):
            raise InvalidInput("'prompt' must be a string", "prompt")
        return payload["prompt"]
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput(SHAPE)
    return checked_messages(messages)


def wants_stream(payload: Any) -> bool:
    """`stream` (default true); also decides where an error about the payload goes."""
    if not isinstance(payload, dict):
        return True
    return payload.get("stream") is not False


def fork_of(payload: Any) -> str | None:
    """`fork_of`: the id of a request with the same prompt (another choice of the same
    call, producer/gateway/choice_fields.py); only a hint, so a bad one is ignored."""
    value = payload.get("fork_of") if isinstance(payload, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 200 else None


def _given(payload: dict[str, Any], name: str, default: Any) -> Any:
    """The value of an optional key; null, as in many clients' JSON, means left out."""
    value = payload.get(name)
    return default if value is None else value


def _integer(payload: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _given(payload, name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidInput(f"'{name}' must be an integer, got {value!r}", name)
    return value


def _number(payload: dict[str, Any], name: str, default: float) -> float:
    value = _given(payload, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _stops(payload: dict[str, Any]) -> tuple[str, ...]:
    stop = _given(payload, "stop", ())
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidInput("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidInput(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS}",
                           "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidInput(f"a 'stop' string has {max(map(len, stops))} characters; at most "
                           f"{MAX_STOP_CHARS}", "stop")
    return tuple(stops)


def sampling_params(payload: dict[str, Any], prompt_len: int, context: int,
                    default_new: int, limit_new: int,
                    vocab: int | None = None) -> SamplingParams:
    """The sampling parameters; `max_new_tokens` is cut to what the context window leaves."""
    if prompt_len >= context:
        raise InvalidInput(f"prompt is {prompt_len} tokens; the context window of this model "
                           f"is {context} tokens (prompt and answer together)",
                           reason="context_window")
    max_new = _integer(payload, "max_new_tokens", default_new)
    assert max_new is not None
    if not 1 <= max_new <= limit_new:
        raise InvalidInput(f"'max_new_tokens' must be between 1 and {limit_new} "
                           f"(max_new_tokens_limit), got {max_new}", "max_new_tokens")
    temperature = _number(payload, "temperature", 0.0)
    top_p = _number(payload, "top_p", 1.0)
    top_k = _integer(payload, "top_k", 0)
    seed = _integer(payload, "seed", None)
    if temperature < 0:
        raise InvalidInput(f"'temperature' must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise InvalidInput(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    if top_k is None or top_k < 0:
        raise InvalidInput(f"'top_k' must be an integer >= 0, got {top_k}", "top_k")
    if not isinstance(_given(payload, "stream", True), bool):
        raise InvalidInput(f"'stream' must be true or false, got {payload['stream']!r}",
                           "stream")
    max_new = min(max_new, context - prompt_len)
    return SamplingParams(max_new, temperature, top_p, min(top_k, TOP_K_CAP), seed,
                          _stops(payload), **penalty_fields(payload, max_new, vocab),
                          **logprob_fields(payload), constraint=constraint_of(payload))
