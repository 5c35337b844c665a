"""Choosing the next token of every row of a forward at once, on the logits' device.

Greedy when a row's `temperature` is 0; otherwise temperature, top-k and top-p (nucleus)
filtering and a Gumbel-max draw: argmax(logits / temperature + g), g = -log(-log(u)). The
uniforms u come from a counter-based hash of the row's key and the token id, in tensor ops
(no torch.Generator, which cannot be batched), and a row's key comes from (seed, index of
the token it draws): the draws of a seeded request do not depend on which other requests
share the batch, nor on preemptions or on a resume by another worker. An unseeded request
is seeded by its entropy (GenerationEngine.add).

Everything but the (seed, index) -> key mixing runs in tensor ops over the whole batch: one
sort when a row filters, no per-row host copy, the chosen tokens are the only result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.models.generation_params import SamplingParams

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
INPUTS_PER_ROW = 4  # temperature and top_p (float64 bits), top_k, key


def splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.'s SplitMix64 finaliser), on host integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_key(seed: int, index: int) -> int:
    """The key of the draw of a sequence's `index`-th token, as a signed int64."""
    key = splitmix64(splitmix64(seed & _M64) ^ index)
    return key - (1 << 64) if key >= 1 << 63 else key


@dataclass(frozen=True, slots=True)
class RowDraws:
    """What the sampler needs of a forward's rows, decided on the host."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    keys: list[int]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
           indices: Sequence[int]) -> RowDraws:
        return cls([p.temperature for p in params], [p.top_p for p in params],
                   [p.top_k for p in params],
                   [draw_key(s, i) for s, i in zip(seeds, indices, strict=True)])

    @property
    def samples(self) -> bool:
        """Whether any row draws (else the step is one argmax)."""
        return any(t != 0 for t in self.temperature)

    @property
    def filters(self) -> bool:
        """Whether any drawing row has top-k or top-p (else no sort is needed)."""
        return any(t != 0 and (k > 0 or p < 1.0)
                   for t, k, p in zip(self.temperature, self.top_k, self.top_p, strict=True))

    def packed(self) -> torch.Tensor:
        """[INPUTS_PER_ROW x rows] int64: the floats by their bits (one copy for all)."""
        floats = torch.tensor(self.temperature + self.top_p, dtype=torch.float64)
        return torch.cat([floats.view(torch.int64), torch.tensor(self.top_k + self.keys)])


def choose_tokens(logits: torch.Tensor, draws: RowDraws,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row of logits [rows, vocab], on their device ([rows], long).
    `packed`: draws.packed() already on the device (else it is copied here)."""
    greedy = torch.argmax(logits, dim=-1)
    if not draws.samples:
        return greedy
    if packed is None:
        packed = draws.packed().to(logits.device)
    rows = logits.shape[0]
    temperature = packed[:rows].view(torch.float64)
    top_p = packed[rows:2 * rows].view(torch.float64)
    top_k, keys = packed[2 * rows:3 * rows], packed[3 * rows:4 * rows]
    scores = logits.float()
    # Shifted so the best score is 0 before the division, and the temperature kept above 0
    # in float32 (1e-300 is not): however small, no score becomes NaN (0 / tiny is 0).
    divisor = temperature.float().clamp_min(torch.finfo(torch.float32).tiny)
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / divisor[:, None]
    if draws.filters:
        scores = _filtered(scores, top_k, top_p)
    drawn = torch.argmax(scores + gumbel(keys, scores.shape[-1]), dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


def _filtered(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scores outside each row's top k, or beyond its nucleus top_p (of what top-k kept),
    set to -inf; a row always keeps its best token."""
    vocab = scores.shape[-1]
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scores.device)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
    keep = ranks[None] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    within = torch.cumsum(probs, dim=-1) - probs <= top_p[:, None]  # keeps the first
    keep &= within | (top_p >= 1.0)[:, None]
    kept = torch.zeros_like(keep).scatter_(1, order, keep)
    return scores.masked_fill(~kept, float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Thomas Mueller's) on int64 tensors holding 32-bit values; its
    multiplier is below 2^27, so no product overflows int64: exact on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 in (0, 1): a hash of each row's key and each token id."""
    low, high = keys & _M32, (keys >> 32) & _M32
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    mixed = _mix32(_mix32(ids[None] ^ high[:, None]) ^ low[:, None])
    return ((mixed >> 8).float() + 0.5) * 2.0 ** -24


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise of each row's key, one per token id."""
    return -torch.log(-torch.log(uniforms(keys, vocab)))
