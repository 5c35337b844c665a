"""Paged KV memory: every sequence's keys and values in one preallocated pool of blocks.

Why: with a cache tensor per sequence, a batched decode step must left-pad and stack all
of them (a copy of the whole batch's cache, and another when the model appends the new
token), and every sequence's cache then stays a view into that padded copy, so memory grows
with rows x longest row. Here a sequence owns a list of fixed-size blocks (its block table,
as in vLLM's paged attention), a step writes only its new tokens into their slots, and each
layer gathers the batch's tokens, one row after another with no padding, into one transient
tensor for attention (execution/paged_attention.py), freed as soon as that layer is done.
Memory is the pool, fixed by the KV budget, whatever the batch.

The pool is `torch.empty`: the operating system commits its pages only once written, and
free blocks are handed out lowest first, so the memory in use stays near the most tokens
ever cached at once. Hand-written, and no transformers cache object: the engine's own
attention function (registered through transformers' AttentionInterface) reads and writes
the pool, so nothing here depends on transformers' cache classes, which change within 5.x.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from worker.policy.decoding import BLOCK_TOKENS  # the scheduler counts in them too

TRASH_BLOCK = 0  # never handed out: padded queries write here, and padding reads it
TRASH_SLOT = TRASH_BLOCK * BLOCK_TOKENS


class KVPoolFull(RuntimeError):
    """More tokens than the pool holds: the scheduler's budget and the pool disagree."""


class KVPool:
    """Per layer, keys and values of shape [slots, kv_heads, head_dim]; slot = block x
    BLOCK_TOKENS + offset."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.blocks = -(-tokens // BLOCK_TOKENS) + 1  # + the trash block
        shape = (self.blocks * BLOCK_TOKENS, kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        for tensor in (*self.keys, *self.values):  # padding reads it: garbage could be NaN,
            tensor[:BLOCK_TOKENS].zero_()  # which a mask cannot hide (NaN + -inf is NaN)
        self.device = device
        self._free = list(range(1, self.blocks))  # a heap: lowest first
        self._shared: dict[int, int] = {}  # block -> its holders beyond the first (forks)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * BLOCK_TOKENS

    def reserve(self, table: list[int], tokens: int) -> None:
        """Grow a block table to hold `tokens` tokens."""
        need = -(-tokens // BLOCK_TOKENS) - len(table)
        if need > len(self._free):
            raise KVPoolFull(f"{tokens} tokens need {need} more blocks; "
                             f"{len(self._free)} are free")
        table.extend(heapq.heappop(self._free) for _ in range(max(0, need)))

    def release(self, table: list[int]) -> None:
        """Give a table's blocks back; a shared block is free once its last holder let go."""
        for block in table:
            holders = self._shared.pop(block, 0)
            if holders > 1:
                self._shared[block] = holders - 1
            elif not holders:
                heapq.heappush(self._free, block)
        table.clear()

    def share(self, table: Sequence[int], tokens: int) -> list[int]:
        """A new table holding the blocks of tokens [0, tokens) of `table` (whole blocks
        only), each held once more: a fork reads a prompt's keys and values without a copy.
        Nobody writes into them again (a holder writes only past its cached tokens)."""
        assert tokens % BLOCK_TOKENS == 0, tokens
        blocks = list(table[:tokens // BLOCK_TOKENS])
        for block in blocks:
            self._shared[block] = self._shared.get(block, 0) + 1
        return blocks

    def slot_list(self, table: Sequence[int], end: int, start: int = 0) -> list[int]:
        """The slots of tokens [start, end) of a block table, on the host."""
        return [table[i // BLOCK_TOKENS] * BLOCK_TOKENS + i % BLOCK_TOKENS
                for i in range(start, end)]

    def slots(self, table: Sequence[int], end: int) -> torch.Tensor:
        """The slots of tokens [0, end) of a block table."""
        blocks = torch.tensor(table[:-(-end // BLOCK_TOKENS)], dtype=torch.long)
        offsets = torch.arange(BLOCK_TOKENS, dtype=torch.long)
        return (blocks[:, None] * BLOCK_TOKENS + offsets).flatten()[:end]
