"""The generative benchmark's workload: real prompts and a long-tailed `max_new_tokens` mix.

Prompts are chat requests over the paragraphs of examples/sentences.txt (real English,
20-1170 characters). `max_new_tokens` is log-uniform squared over [8, 256]: most requests
want a few dozen tokens, a few want hundreds, as in a chat service. Both are seeded, so every
system in one run gets exactly the same requests; the token ids come from the worker's own
`prepare`, so the offline runs see what the worker sees.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from bench.common.paths import SENTENCES

MIN_NEW, MAX_NEW = 8, 256
INSTRUCTIONS = ("Explain this in your own words: ", "Summarise in one paragraph: ",
                "What does this mean? ", "Write a short note about this: ")


@dataclass(frozen=True, slots=True)
class GenRequest:
    payload: dict[str, Any]  # what a producer sends (stream false: one envelope back)
    prompt_ids: list[int]  # as the worker tokenises it
    max_new_tokens: int


def long_tailed(rng: random.Random, low: int = MIN_NEW, high: int = MAX_NEW) -> int:
    """Log-uniform with the exponent squared: median ~ low x (high/low)^0.25, tail to high."""
    return round(low * (high / low) ** (rng.random() ** 2))


def build_workload(model: Any, count: int, seed: int = 0) -> list[GenRequest]:
    """`count` requests; `model` is a loaded generative Model (for its tokeniser)."""
    rng = random.Random(seed)
    paragraphs = [line for line in SENTENCES.read_text().splitlines() if line.strip()]
    requests = []
    for index in range(count):
        text = rng.choice(INSTRUCTIONS) + paragraphs[(seed + index * 7) % len(paragraphs)]
        wanted = long_tailed(rng)
        payload = {"messages": [{"role": "user", "content": text}],
                   "max_new_tokens": wanted, "stream": False}
        prepared = model.prepare(payload, 0)
        requests.append(GenRequest(payload, prepared.data.prompt_ids, wanted))
    return requests


def describe(requests: list[GenRequest]) -> dict[str, Any]:
    """Prompt lengths and the max_new_tokens mix, for the report."""
    prompts = sorted(len(r.prompt_ids) for r in requests)
    wanted = sorted(r.max_new_tokens for r in requests)

    def quartiles(values: list[int]) -> list[int]:
        return [values[int(q * (len(values) - 1))] for q in (0, 0.25, 0.5, 0.75, 1)]

    return {"requests": len(requests), "prompt_tokens_quartiles": quartiles(prompts),
            "max_new_tokens_quartiles": quartiles(wanted),
            "max_new_tokens_mean": sum(wanted) / len(wanted)}
