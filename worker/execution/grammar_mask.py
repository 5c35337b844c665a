"""The token masks of a forward's constrained rows: filled on the host, applied on the device.

A constrained sequence holds an llguidance matcher (compiled by pipeline/grammars.py),
advanced with each token it appends (`advance`). Before a forward's draw, every emitting
constrained row's allowed tokens are filled by llguidance (its executor, the GIL released)
into one preallocated host buffer of int32 words (a bit per token; pinned on CUDA, so the
copy is asynchronous): the rows' indices first, then their masks. That buffer's used part
goes to a preallocated device buffer in one copy. On the device each mask byte picks its 8
tokens' biases (0, or -inf where forbidden) from a 256 x 8 table (one embedding gather), and
one index_add puts them on the constrained rows' logits, in place (written here:
llguidance.torch compiles a kernel with torch.compile on its first call; this is 6-10x
faster on a CPU than expanding the bits with shifts and a masked fill). The mask is applied
before penalties and the draw; EOS is allowed only where the matcher accepts.

On a GPU the fill runs after the forward is launched, while the device computes. Nothing is
allocated per step but the few small tensors of the fill on the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from worker.policy.decoding import Work

WORD_BITS = 32


def constrained(seqs: Iterable[Any]) -> bool:
    """Whether a sequence has a grammar (its mask needs its previous token on the host)."""
    return any(seq.matcher is not None for seq in seqs)


def mask_vocab(vocab: int, tokenizer: Any) -> int:
    """Bits per mask row: the logits' width, or the tokenizer's count where it knows more
    tokens (llguidance wants a bit for each; those past the logits are never drawn)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    known = backend.get_vocab_size(with_added_tokens=True) if backend else len(tokenizer)
    return max(vocab, known)


def words_of(vocab: int) -> int:
    """int32 words per mask row: one bit per token of the vocabulary."""
    return (vocab + WORD_BITS - 1) // WORD_BITS


class GrammarMasks:
    """The preallocated mask buffers of an engine, and its sequences' matcher failures."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 64) -> None:
        self.vocab, self.words, self.device = vocab, words_of(vocab), device
        self.failed: dict[str, str] = {}  # sequence id -> llguidance's error
        self.executor: Any = None  # llguidance's LLExecutor, made with the first fill
        self.fills, self.fill_s = 0, 0.0  # forwards masked and the host's seconds on them
        self._allocate(rows)
        self.tables: dict[torch.dtype, torch.Tensor] = {}  # per logits dtype: byte -> biases

    def _allocate(self, rows: int) -> None:
        """[rows] row indices, then [rows x words] masks, on the host and on the device."""
        self.rows = rows
        size = rows * (1 + self.words)
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
        self.on_device = self.host if self.device.type == "cpu" else torch.zeros(
            size, dtype=torch.int32, device=self.device)

    def fill(self, seqs: Sequence[Any], works: Sequence[Work]) -> int:
        """Fill the masks of the emitting rows whose sequence has a matcher (their row index
        first) and copy them to the device; returns how many rows are masked (0: none)."""
        masked = [(row, seq) for row, (seq, work) in enumerate(zip(seqs, works, strict=True))
                  if work.emits and seq.matcher is not None and not seq.ended]
        if not masked:
            return 0
        started = time.perf_counter()
        if len(masked) > self.rows:  # more rows than any step had so far: once
            self._allocate(max(len(masked), 2 * self.rows))
        count = len(masked)
        self.host[:count] = torch.tensor([row for row, _ in masked], dtype=torch.int32)
        start = self.host[self.rows:].data_ptr()
        self._executor().unsafe_compute_mask_ptr(
            [(seq.matcher, i) for i, (_, seq) in enumerate(masked)], start,
            self.words * 4, self.rows)
        for _, seq in masked:
            if seq.matcher.is_error():
                self.failed[seq.id] = seq.matcher.get_error()[:300]
        if self.on_device is not self.host:  # indices and masks: one copy
            self.on_device[:self.rows + count * self.words].copy_(
                self.host[:self.rows + count * self.words], non_blocking=True)
        self.fills, self.fill_s = self.fills + 1, self.fill_s + time.perf_counter() - started
        return count

    def _executor(self) -> Any:
        if self.executor is None:
            from llguidance import LLExecutor

            self.executor = LLExecutor()
        return self.executor

    def apply(self, logits: torch.Tensor, count: int) -> torch.Tensor:
        """The logits [rows, vocab], in place, with the masked rows' forbidden tokens at -inf.
        A token's bit is bit t % 8 of byte t // 8 (int32 words, little-endian)."""
        rows = self.on_device[:count].long()
        masks = self.on_device[self.rows:self.rows + count * self.words].view(torch.uint8)
        biases = torch.nn.functional.embedding(masks.long(), self._table(logits.dtype))
        return logits.index_add_(0, rows, biases.view(count, -1)[:, :logits.shape[1]])

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        """[256, 8]: for each byte, its 8 bits' biases (0 where set, -inf where clear)."""
        if dtype not in self.tables:
            bits = torch.arange(256)[:, None] >> torch.arange(8) & 1
            self.tables[dtype] = torch.zeros(256, 8, dtype=dtype).masked_fill(
                bits == 0, float("-inf")).to(self.device)
        return self.tables[dtype]

    def advance(self, seq: Any, token: int) -> None:
        """The sequence's matcher past its new token (a refused token is a failure)."""
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            self.failed.setdefault(seq.id, seq.matcher.get_error() or
                                   f"token {token} does not match the grammar")

    def replay(self, seq: Any, tokens: Sequence[int]) -> None:
        """A resumed sequence's matcher rebuilt from the tokens streamed before."""
        if seq.matcher is not None and tokens and not seq.matcher.consume_tokens(list(tokens)):
            self.failed.setdefault(seq.id, "the resumed tokens do not match the grammar: "
                                   + seq.matcher.get_error())

    def failures(self) -> dict[str, str]:
        """The sequences whose matcher failed since the last call, with llguidance's error."""
        failed, self.failed = self.failed, {}
        return failed
