"""Paged KV memory: every sequence's keys and values in one preallocated pool of blocks.

Why: with a cache tensor per sequence, a batched decode step must left-pad and stack all
of them (a copy of the whole batch's cache, and another when the model appends the new
token), and every sequence's cache then stays a view into that padded copy, so memory grows
with rows x longest row. Here a sequence owns a list of fixed-size blocks (its block table,
as in vLLM's paged attention), a step writes only its new tokens into their slots, and each
layer gathers the batch's slots into one transient tensor for attention, freed as soon as
that layer is done. Memory is the pool, fixed by the KV budget, whatever the batch.

The pool is `torch.empty`: the operating system commits its pages only once written, and
free blocks are handed out lowest first, so the memory in use stays near the most tokens
ever cached at once. Hand-written (transformers' own PagedAttentionCache belongs to its
ContinuousBatchingManager and needs its paged attention kernels); the gather is plain
`index_select`, so any attention implementation (sdpa, eager) sees ordinary tensors.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

BLOCK_TOKENS = 16
TRASH_SLOT = 0  # block 0 is never handed out: padding reads point here, masked out


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
        for block in table:
            heapq.heappush(self._free, block)
        table.clear()

    def slots(self, table: Sequence[int], end: int) -> torch.Tensor:
        """The slots of tokens [0, end) of a block table."""
        blocks = torch.tensor(table[:-(-end // BLOCK_TOKENS)], dtype=torch.long)
        offsets = torch.arange(BLOCK_TOKENS, dtype=torch.long)
        return (blocks[:, None] * BLOCK_TOKENS + offsets).flatten()[:end]


class StepLayout:
    """Where one forward's tokens go and what each row attends to: rows of `queries`
    new tokens each (left-padded to the longest), row r's tokens ending at `ends[r]`."""

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]], starts: Sequence[int],
                 ends: Sequence[int]) -> None:
        queries = max(e - s for s, e in zip(starts, ends, strict=True))
        length = max(ends)
        read = torch.full((len(ends), length), TRASH_SLOT, dtype=torch.long)
        write = torch.full((len(ends), queries), TRASH_SLOT, dtype=torch.long)
        for row, (table, start, end) in enumerate(zip(tables, starts, ends, strict=True)):
            slots = pool.slots(table, end)
            read[row, :end] = slots
            write[row, queries - (end - start):] = slots[start:]
        self.rows, self.queries, self.length = len(ends), queries, length
        self.read = read.flatten().to(pool.device)
        self.write = write.flatten().to(pool.device)
        ends_t = torch.tensor(ends, dtype=torch.long)
        # the position of each query: padded queries repeat their row's first real one
        offsets = torch.arange(queries - 1, -1, -1, dtype=torch.long)
        lens = torch.tensor([e - s for s, e in zip(starts, ends, strict=True)])
        self.positions = (ends_t[:, None] - 1 - torch.minimum(offsets[None], lens[:, None] - 1)
                          ).to(pool.device)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, 1, queries, length], additive: a query sees its row's tokens up to itself."""
        keys = torch.arange(self.length, device=self.positions.device)
        seen = keys[None, None, :] <= self.positions[:, :, None]
        blocked = torch.finfo(dtype).min
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
            ~seen, blocked)[:, None]


class PagedLayer(CacheLayerMixin):
    """One layer of one forward: writes the new keys and values into their slots, and
    returns every row's tokens gathered (and right-padded) for attention."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, layout: StepLayout) -> None:
        super().__init__()
        self.pool_keys, self.pool_values, self.layout = keys, values, layout
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool exists before the forward."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout
        return (self._put_and_gather(self.pool_keys, key_states, layout),
                self._put_and_gather(self.pool_values, value_states, layout))

    @staticmethod
    def _put_and_gather(pool: torch.Tensor, new: torch.Tensor,
                        layout: StepLayout) -> torch.Tensor:
        heads, dim = new.shape[1], new.shape[3]  # new: [rows, heads, queries, dim]
        pool.index_copy_(0, layout.write, new.transpose(1, 2).reshape(-1, heads, dim))
        gathered = pool.index_select(0, layout.read).view(layout.rows, layout.length,
                                                          heads, dim)
        return gathered.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layout.length, 0

    def get_seq_length(self) -> int:
        return self.layout.length - self.layout.queries

    def get_max_length(self) -> int:
        return -1


def step_cache(pool: KVPool, layout: StepLayout) -> Cache:
    """The Cache one forward sees: the pool's layers through one layout."""
    return Cache(layers=[PagedLayer(k, v, layout)
                         for k, v in zip(pool.keys, pool.values, strict=True)])
