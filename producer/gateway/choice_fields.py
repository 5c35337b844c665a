"""`n` and lists of prompts on /v1/chat/completions and /v1/completions, checked (400
`invalid_request` naming the field), and the payloads they become.

A request asks for n choices of each of its prompts (completions takes a list of strings;
lists of token ids stay 400 `unsupported_input`). Each choice is its own generation on the
workers (producer/gateway/choices.py runs them): choice index i * n + j is prompt i's
sample j, as OpenAI numbers them, and a `seed` s becomes s + j for sample j, so a choice is
the same request run alone with that seed. The gateway's `max_choices` setting bounds
prompts x n (checked in `check_choices`, where the settings are known).
"""

from __future__ import annotations

from typing import Any

from producer.gateway.errors import invalid

MAX_N = 128  # past any max_choices setting worth having: refused before anything else
MAX_PROMPTS = 2048


def parse_n(fields: dict[str, Any]) -> int:
    n = fields.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise invalid("'n' must be a positive integer", "n")
    if n > MAX_N:
        raise invalid(f"'n' is {n}; at most {MAX_N}", "n")
    return n


def parse_prompts(value: Any) -> list[str]:
    """Completions' `prompt`: one string or a non-empty list of them."""
    prompts = [value] if isinstance(value, str) else value
    if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS}",
                          "prompt")
        return prompts
    if isinstance(prompts, list) and prompts and all(
            isinstance(p, int) or isinstance(p, list) for p in prompts):
        raise invalid("'prompt' must be a string or a list of strings: token ids are not "
                      "supported", "prompt", "unsupported_input")
    raise invalid("'prompt' is required: a string or a non-empty list of strings", "prompt")


def check_choices(prompts: int, n: int, max_choices: int) -> None:
    """400 naming `n` (or `prompt`) when prompts x n is past the gateway's max_choices."""
    if prompts * n > max_choices:
        field = "n" if n > 1 else "prompt"
        raise invalid(f"{prompts} prompt(s) x n = {n} asks for {prompts * n} choices; at "
                      f"most {max_choices} (the gateway's max_choices)", field)


def choice_payloads(payload: dict[str, Any], prompts: list[str] | None,
                    n: int) -> list[dict[str, Any]]:
    """One worker payload per choice, in choice order (prompt-major); sample j of a seeded
    request has seed + j."""
    out = []
    targets: list[str | None] = list(prompts) if prompts else [None]
    for prompt in targets:
        for j in range(n):
            choice = dict(payload)
            if prompt is not None:
                choice["prompt"] = prompt
            if "seed" in payload:
                choice["seed"] = payload["seed"] + j
            out.append(choice)
    return out
