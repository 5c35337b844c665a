"""Log probabilities of the chosen tokens and of each row's best alternatives (`logprobs`).

As vLLM's default ("raw" logprobs): from the forward's logits as the model gives them (after
a grammar's mask, were there one), before penalties, logit_bias and temperature, so they
describe the model, not the sampler. For a whole forward in one op: log_softmax over the
rows, the chosen tokens' values gathered, and one top-k of the widest row's count.

They come back to the host in the step's one device-to-host copy (generation.py): each
forward's result tensor is its tokens [rows] followed by its tail [rows x (1 + 2 x width)]
(the chosen logprobs as float64 bits, then the top ids, then their logprobs as float64
bits); a step's tokens go first, all its tails after them, so a token's index (which the
next step's decoding rows read on the device, staging.py) does not move. A forward where no
row asks for logprobs has no tail, and its steps are as before.

On the host each token becomes OpenAI's chat record {token, logprob, bytes, top_logprobs};
the gateway shapes the completions form from it (producer/gateway/logprob_shapes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

Record = dict[str, Any]


class Seq(Protocol):
    @property
    def text(self) -> Any: ...


def top_width(seqs: Sequence[Seq]) -> int | None:
    """How many alternatives the forward's widest row asks for; None when none asks for
    logprobs (no tail)."""
    asked = [s.text.params.logprobs for s in seqs if s.text.params.logprobs is not None]
    return max(asked) if asked else None


def tail(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> torch.Tensor:
    """[rows x (1 + 2 x width)] int64 on the logits' device: the chosen tokens' logprobs,
    the `width` best ids of each row and their logprobs (floats as float64 bits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None].long())[:, 0]
    parts = [chosen.double().view(torch.int64)]
    if width:
        values, ids = torch.topk(logprobs, width, dim=-1)
        parts += [ids.flatten(), values.double().flatten().view(torch.int64)]
    return torch.cat(parts)


def with_logprobs(forward: Any, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The forward's result: its tokens, then their tail if a row asks for logprobs
    (`forward.logprobs` records the width for `host_rows`)."""
    forward.logprobs = top_width(forward.seqs)
    if forward.logprobs is None:
        return tokens
    return torch.cat([tokens, tail(logits, tokens, forward.logprobs)])


def sent_back(results: Sequence[tuple[Any, torch.Tensor]]) -> torch.Tensor:
    """The forwards' results in one tensor: every token first, then every tail."""
    if len(results) == 1:
        return results[0][1]
    tokens = [t[:len(f.seqs)] for f, t in results]
    return torch.cat(tokens + [t[len(f.seqs):] for f, t in results if f.logprobs is not None])


def host_rows(forwards: Sequence[Any], host: torch.Tensor | None,
              texts: TokenTexts) -> list[tuple[list[int], list[Record | None]]]:
    """Each forward's tokens and, per row, its logprob record (None where the row did not
    ask), from the step's result on the host."""
    if host is None:
        return []
    rows = [len(f.seqs) for f in forwards]
    tokens: list[int] = host[:sum(rows)].tolist()
    out, at, tail_at = [], 0, sum(rows)
    for forward, count in zip(forwards, rows, strict=True):
        chosen = tokens[at:at + count]
        width = forward.logprobs
        records: list[Record | None] = [None] * count
        if width is not None:
            size = count * (1 + 2 * width)
            records = _records(forward.seqs, chosen, host[tail_at:tail_at + size], width,
                               texts)
            tail_at += size
        out.append((chosen, records))
        at += count
    return out


def _records(seqs: Sequence[Seq], chosen: list[int], part: torch.Tensor, width: int,
             texts: TokenTexts) -> list[Record | None]:
    rows = len(chosen)
    logprobs = part[:rows].view(torch.float64).tolist()
    ids = part[rows:rows + rows * width].view(rows, width).tolist()
    values = part[rows + rows * width:].view(torch.float64).view(rows, width).tolist()
    records: list[Record | None] = []
    for row, seq in enumerate(seqs):
        top = seq.text.params.logprobs
        records.append(None if top is None else texts.record(
            chosen[row], logprobs[row], list(zip(ids[row][:top], values[row][:top],
                                                 strict=True))))
    return records


def attach(kept: list[Record], delta: Any, record: Record | None,
           eos_ids: frozenset[int]) -> None:
    """The new token's record kept (an EOS token's is not: it has no text), and the delta
    given the records of its tokens."""
    if record is None:
        return
    if record["id"] in eos_ids:  # it ends the delta's tokens
        count = len(delta.token_ids) - 1
    else:
        kept.append(record)
        count = len(delta.token_ids)
    if delta.token_ids:
        delta.logprobs = [public(r) for r in kept[len(kept) - count:]] if count else []


def public(record: Record) -> Record:
    """The record as sent (its token id is kept for the engine only)."""
    return {key: value for key, value in record.items() if key != "id"}


class TokenTexts:
    """Each token id's text and UTF-8 bytes, worked out once. A byte-level BPE token's
    bytes are its own (a part of a character included), from the GPT-2 byte table."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_level = _byte_level(tokenizer)

    def text(self, token: int) -> tuple[str, list[int]]:
        known = self.cache.get(token)
        if known is None:
            known = self.cache[token] = self._work_out(token)
        return known

    def _work_out(self, token: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token) if self.byte_level else None
        if isinstance(piece, str) and all(c in self.byte_level for c in piece):
            raw = bytes(self.byte_level[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = str(self.tokenizer.decode([token]))
        return text, list(text.encode("utf-8"))

    def record(self, token: int, logprob: float, top: list[tuple[int, float]]) -> Record:
        text, raw = self.text(token)
        return {"id": token, "token": text, "logprob": logprob, "bytes": raw,
                "top_logprobs": [{"token": self.text(i)[0], "logprob": v,
                                  "bytes": self.text(i)[1]} for i, v in top]}


def _byte_level(tokenizer: Any) -> dict[str, int]:
    """GPT-2's printable character -> byte table where the tokenizer decodes byte-level
    (SmolLM2, GPT-2, Llama 3), else empty."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder):
        return {}
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            chars.append(256 + extra)
            printable.append(byte)
            extra += 1
    return {chr(c): b for c, b in zip(chars, printable, strict=True)}
