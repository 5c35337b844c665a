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
from functools import cached_property

import torch

BLOCK_TOKENS = 16
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

    def slot_list(self, table: Sequence[int], end: int, start: int = 0) -> list[int]:
        """The slots of tokens [start, end) of a block table, on the host."""
        return [table[i // BLOCK_TOKENS] * BLOCK_TOKENS + i % BLOCK_TOKENS
                for i in range(start, end)]

    def slots(self, table: Sequence[int], end: int) -> torch.Tensor:
        """The slots of tokens [0, end) of a block table."""
        blocks = torch.tensor(table[:-(-end // BLOCK_TOKENS)], dtype=torch.long)
        offsets = torch.arange(BLOCK_TOKENS, dtype=torch.long)
        return (blocks[:, None] * BLOCK_TOKENS + offsets).flatten()[:end]




class StepLayout:
    """Where one forward's tokens go and what each row attends to: rows of `queries`
    new tokens each (left-padded to the longest), row r's new tokens at positions
    [starts[r], ends[r]) and its history (every token up to ends[r]) at
    history[offsets[r]:offsets[r] + ends[r]].

    Built on the host as lists (`host`: write, history, positions); the engine copies them
    to the device with the rest of its step (execution/step_buffers.py) and `bind`s the
    device views; `bind=True` copies them here instead (tests, tools)."""

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]], starts: Sequence[int],
                 ends: Sequence[int], bind: bool = True,
                 slots: Sequence[list[int]] | None = None) -> None:
        """`slots`: each row's slots of tokens [0, end) if the caller keeps them (the
        engine does, extended as a sequence grows), else they are computed here."""
        self.pool, self.tables = pool, [list(t) for t in tables]
        self.starts, self.ends = list(starts), list(ends)
        queries = max(e - s for s, e in zip(starts, ends, strict=True))
        self.rows, self.queries, self.length = len(ends), queries, max(ends)
        self.attended = 0  # layers whose attention used this layout (paged_attention.py)
        self.offsets = [sum(self.ends[:row]) for row in range(self.rows)]
        write: list[int] = []
        history: list[int] = []
        positions: list[int] = []
        for row, (table, start, end) in enumerate(zip(tables, starts, ends, strict=True)):
            own = pool.slot_list(table, end) if slots is None else slots[row]
            own = own if len(own) == end else own[:end]
            pad = queries - (end - start)  # padded queries write to the trash block and
            write += [TRASH_SLOT] * pad + own[start:]  # repeat their row's first position
            history += own
            positions += [start] * pad + list(range(start, end))
        self.host = (write, history, positions)
        if bind:
            self.bind(*(torch.tensor(part, dtype=torch.long).to(pool.device)
                        for part in self.host))

    def bind(self, write: torch.Tensor, history: torch.Tensor,
             positions: torch.Tensor) -> None:
        """The layout's tensors on the device (flat, as `host` holds them)."""
        self.write, self.history = write, history
        self.positions = positions.view(self.rows, self.queries)

    @cached_property
    def read(self) -> torch.Tensor:
        """Every row's slots right-padded to the longest (with TRASH_SLOT), flattened: the
        padded view one batched attention would gather (kept for tests and tools)."""
        read = torch.full((self.rows, self.length), TRASH_SLOT, dtype=torch.long)
        for row, (table, end) in enumerate(zip(self.tables, self.ends, strict=True)):
            read[row, :end] = self.pool.slots(table, end)
        return read.flatten().to(self.pool.device)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, 1, queries, length], additive, for the padded view: a query sees its row's
        tokens up to itself."""
        keys = torch.arange(self.length, device=self.positions.device)
        seen = keys[None, None, :] <= self.positions[:, :, None]
        blocked = torch.finfo(dtype).min
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
            ~seen, blocked)[:, None]


class DecodeLayout:
    """One decoding forward as fixed shapes: `rows` rows of one new token each (the real
    ones first, the rest padding), each row reading `length` slots (its block table's, then
    the trash block's), masked past its own length. Why: one gather and one attention call
    per layer for the whole batch instead of one per row (a GPU pays per launch), in shapes
    that change only by class (`shape`), so a CUDA graph can replay the step
    (execution/decode_graphs.py). Padding rows write to and read the trash block, at
    position 0, with one visible key.

    Built on the host (`host`: write, tables, lengths, positions: block tables, not slots,
    so a step uploads a sixteenth of its reads); `bind` takes their device views (or a
    graph's static buffers). The slots read and the mask are worked out on the device by
    the first layer that needs them, inside the forward (so inside a captured graph)."""

    queries = 1

    def __init__(self, pool: KVPool, tables: Sequence[Sequence[int]],
                 lengths: Sequence[int], shape: tuple[int, int], bind: bool = True) -> None:
        """`lengths`: each real row's tokens, its new one included; `shape`: the padded
        (rows, context length) class, which must hold them."""
        self.pool, self.shape, self.real = pool, shape, len(lengths)
        self.rows, blocks = shape[0], -(-shape[1] // BLOCK_TOKENS)
        self.length = blocks * BLOCK_TOKENS
        assert self.real <= self.rows and max(lengths, default=1) <= self.length
        pad = self.rows - self.real
        write = [table[(n - 1) // BLOCK_TOKENS] * BLOCK_TOKENS + (n - 1) % BLOCK_TOKENS
                 for table, n in zip(tables, lengths, strict=True)] + [TRASH_SLOT] * pad
        flat: list[int] = []
        for table in tables:
            own = list(table[:blocks])
            flat += own + [TRASH_BLOCK] * (blocks - len(own))
        flat += [TRASH_BLOCK] * (blocks * pad)
        padded = list(lengths) + [1] * pad
        self.host = (write, flat, padded, [n - 1 for n in padded])
        if bind:
            self.bind(*(torch.tensor(part, dtype=torch.long).to(pool.device)
                        for part in self.host))

    def bind(self, write: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
             positions: torch.Tensor) -> None:
        self.write, self.tables, self.lengths = write, tables, lengths
        self.positions = positions.view(self.rows, 1)
        self.reset()

    def reset(self) -> None:
        """Forget what the layers worked out (before a forward that reuses the buffers)."""
        self.attended = 0
        self._read: torch.Tensor | None = None
        self._visible: dict[int | None, torch.Tensor] = {}

    @property
    def read(self) -> torch.Tensor:
        """Every row's `length` slots, flattened: [rows x length]; a slot past the row's
        length reads the trash block (a slot not written yet may hold NaN, which a masked
        attention weight of 0 would still spread: 0 x NaN is NaN)."""
        if self._read is None:
            offsets = torch.arange(BLOCK_TOKENS, device=self.tables.device)
            slots = (self.tables.view(self.rows, -1, 1) * BLOCK_TOKENS + offsets)
            keys = torch.arange(self.length, device=self.tables.device)[None]
            written = keys < self.lengths[:, None]
            self._read = torch.where(written, slots.view(self.rows, -1), TRASH_SLOT).flatten()
        return self._read

    def visible(self, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, length]: the keys each row's query sees (its own, within a sliding
        window if any)."""
        if window not in self._visible:
            keys = torch.arange(self.length, device=self.lengths.device)[None]
            seen = keys < self.lengths[:, None]
            if window:
                seen &= keys >= self.lengths[:, None] - window
            self._visible[window] = seen[:, None, None]
        return self._visible[window]
