"""How one forward's tokens map onto the paged KV pool (execution/kv_pool.py): which slots
its new tokens write, which each query reads, at which positions. The engine's attention
function (execution/paged_attention.py) reads the layout of the forward it runs in.

- StepLayout: rows of new tokens, left-padded to the longest; each row attends alone over
  exactly its own history (a CPU: no padded work at all).
- DecodeLayout: a decode step's rows, one token each, padded to a shape class; one gather
  and one masked attention call per layer, in shapes a CUDA graph can replay (a GPU).
- PackedLayout: a step's prefill chunks packed one after another into a single row with
  no padding between them; one gather and one attention call per layer, masked so each
  token sees its own sequence up to itself (a GPU: one forward for every prompt of the
  step), padded at the end to a (queries, keys) class a CUDA graph can replay.

Each is built on the host as lists (`host`), copied to the device with the rest of the step
(execution/step_buffers.py), and `bind`s the device views; `bind=True` copies them itself
(tests, tools).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

from worker.execution.kv_pool import BLOCK_TOKENS, TRASH_BLOCK, TRASH_SLOT, KVPool

PAD_SEQ = -1  # a padded packed prefill's padding queries and keys: no real row's


def last_query(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logits of its last query, from the forward's [rows, kept, vocab]."""
    return logits[:, -1]


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

    keep = 1  # the forward's `logits_to_keep`: each row's last query
    last_logits = staticmethod(last_query)

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
    (execution/step_graphs.py). Padding rows write to and read the trash block, at
    position 0, with one visible key.

    Built on the host (`host`: write, tables, lengths, positions: block tables, not slots,
    so a step uploads a sixteenth of its reads); `bind` takes their device views (or a
    graph's static buffers). The slots read and the mask are worked out on the device by
    the first layer that needs them, inside the forward (so inside a captured graph)."""

    queries = 1
    keep = 1
    last_logits = staticmethod(last_query)

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
        self.bound = (write, tables, lengths, positions)  # what a graph's replay copies
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


class PackedLayout:
    """Prefill chunks packed one after another into one row of `queries` tokens, no
    padding between them: row r's new tokens at positions [starts[r], ends[r]) write their
    slots, and each attends to its own sequence's keys up to itself, read from the pool
    (every row's history, one after another). The logits kept are each row's last token's.

    With a `shape` (queries, keys) class and a number of `rows`, the layout is padded to
    fixed sizes a CUDA graph can replay (execution/step_graphs.py): padding queries (token 0
    at position 0, sequence PAD) write the trash slot and read the padding keys (the trash
    slot, sequence PAD), so they attend to one finite key, never to a real row's, and no
    real query sees them; padding rows keep the first token's logits. Padding queries need
    a padding key: `keys` must exceed the real keys."""

    rows = 1

    def __init__(self, pool: KVPool, slots: Sequence[Sequence[int]], starts: Sequence[int],
                 ends: Sequence[int], bind: bool = True, shape: tuple[int, int] | None = None,
                 rows: int = 0) -> None:
        """`slots`: each row's slots of tokens [0, end) at least."""
        self.pool, self.real, self.shape = pool, len(ends), shape
        write: list[int] = []
        read: list[int] = []
        positions: list[int] = []
        query_seqs: list[int] = []
        key_seqs: list[int] = []
        key_positions: list[int] = []
        last: list[int] = []
        for row, (own, start, end) in enumerate(zip(slots, starts, ends, strict=True)):
            write += own[start:end]
            read += own[:end]
            positions += range(start, end)
            query_seqs += [row] * (end - start)
            key_seqs += [row] * end
            key_positions += range(end)
            last.append(len(write) - 1)
        if shape is not None:
            pad_queries, pad_keys = shape[0] - len(write), shape[1] - len(read)
            assert pad_queries >= 0 and pad_keys > 0 and rows >= self.real, (shape, rows)
            write += [TRASH_SLOT] * pad_queries
            positions += [0] * pad_queries
            query_seqs += [PAD_SEQ] * pad_queries
            read += [TRASH_SLOT] * pad_keys
            key_seqs += [PAD_SEQ] * pad_keys
            key_positions += [0] * pad_keys
            last += [0] * (rows - self.real)
        self.queries, self.length = len(write), len(read)
        self.host = (write, read, positions, query_seqs, key_seqs, key_positions, last)
        if bind:
            self.bind(*(torch.tensor(part, dtype=torch.long).to(pool.device)
                        for part in self.host))

    def bind(self, write: torch.Tensor, read: torch.Tensor, positions: torch.Tensor,
             query_seqs: torch.Tensor, key_seqs: torch.Tensor, key_positions: torch.Tensor,
             last: torch.Tensor) -> None:
        self.bound = (write, read, positions, query_seqs, key_seqs, key_positions, last)
        self.write, self.read, self.query_seqs, self.key_seqs = write, read, query_seqs, key_seqs
        self.key_positions = key_positions
        self.positions = positions.view(1, self.queries)
        self.keep = last  # the forward's `logits_to_keep`: each row's last token
        self.reset()

    def reset(self) -> None:
        """Forget what the layers worked out (before a forward that reuses the buffers)."""
        self.attended = 0
        self._visible: dict[int | None, torch.Tensor] = {}

    @staticmethod
    def last_logits(logits: torch.Tensor) -> torch.Tensor:
        return logits[0]

    def visible(self, window: int | None) -> torch.Tensor:
        """[1, 1, queries, length]: a query sees its own sequence's keys up to its position
        (within a sliding window if any); worked out on the device by the first layer."""
        if window not in self._visible:
            at, keys = self.positions[0][:, None], self.key_positions[None]
            seen = (self.query_seqs[:, None] == self.key_seqs[None]) & (keys <= at)
            if window:
                seen &= keys > at - window
            self._visible[window] = seen[None, None]
        return self._visible[window]
