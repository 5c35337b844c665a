"""Forks: sequences of the same prompt (the n choices of one call) sharing its KV blocks.

A sequence added with `fork_of` names another of the same prompt. When its prefill starts
(its first chunk, from token 0) and that sequence's cache already holds the prompt, it takes
the prompt's whole blocks from it by reference (KVPool.share: no copy, a holder count per
block) and prefills only the rest: the tokens of the last, partial block (at least the
prompt's last token, whose logits draw its first token). So n choices prefill a long
prompt about once, and hold one copy of it in the pool.

The scheduler holds a fork back until the sequence it names has its prompt cached
(policy/decoding.py, `after`); its own token budget still counts the shared tokens, so the
pool never holds more than the scheduler believes. A fork that finds no such sequence (it
finished, was cancelled or preempted, or runs on another worker) prefills alone: sharing
saves work, and never changes what is correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.execution.kv_pool import BLOCK_TOKENS
from worker.observe import metrics
from worker.policy.decoding import Work


def shareable(prompt: Sequence[int], work: Work) -> int:
    """How many of the prompt's tokens a fork can take from another (whole blocks, before
    the prompt's last token and before the end of its first chunk)."""
    last = min(len(prompt), work.end) - 1
    return max(0, last) // BLOCK_TOKENS * BLOCK_TOKENS


def shared_prefill(engine: Any, works: list[Work]) -> list[Work]:
    """The step's prefill works, those of forks that took their prompt's blocks from the
    sequence they name starting after them."""
    out = []
    for work in works:
        seq = engine.seqs[work.id]
        source = engine.seqs.get(seq.fork_of) if seq.fork_of and work.start == 0 else None
        tokens = shareable(seq.prompt_ids, work) if source is not None else 0
        if source is None or not tokens or source.cached < tokens or source.ended \
                or source.prompt_ids[:tokens] != seq.prompt_ids[:tokens] or seq.blocks:
            out.append(work)
            continue
        seq.blocks = engine.pool.share(source.blocks, tokens)
        seq.slots = engine.pool.slot_list(seq.blocks, tokens)
        seq.cached = tokens
        engine.shared_tokens += tokens
        metrics.PROMPT_TOKENS_SHARED.inc(tokens)
        out.append(Work(work.id, tokens, work.end, work.emits))
    return out
