"""Turning a sequence's generated tokens into streamed text, one token at a time.

Incremental, as vLLM's and TGI's detokenisers are: each new token decodes only a short
window, the tokens from `prefix` (a few already-read ones, for context such as a leading
space) to the end, and its text beyond what the window's first part, up to `read`, decoded
to is new. While the window's text ends in an incomplete UTF-8 character ("\\ufffd") the
token is left unread until the next one completes it; when the sequence finishes, whatever
is unread is flushed as it decodes. So a step costs a few tokens' decode however long the
answer already is, and the text is the one a decode of every token gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.execution.stop_strings import StopStrings
from worker.models.generation_params import SamplingParams

Decode = Callable[[Sequence[int]], str]
CONTEXT_TOKENS = 5  # already-read tokens decoded with the new ones (vLLM's window)
REPLACEMENT = "\ufffd"  # what a decode gives for an incomplete UTF-8 character


def decoder_of(tokenizer: Any) -> Decode:
    """The tokenizer's decode, special tokens skipped. Where the Hugging Face wrapper adds
    nothing to its Rust tokenizer's decode (no clean-up of spaces), the Rust decode itself:
    the wrapper's checks of every id cost twice the decode (two decodes a token a row are
    a step's largest host cost on a GPU)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        def rust(token_ids: Sequence[int]) -> str:
            return str(backend.decode(token_ids, skip_special_tokens=True))
        return rust

    def wrapped(token_ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))
    return wrapped


@dataclass(slots=True)
class Delta:
    """What one step added to a sequence's answer: text and the tokens behind it."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    logprobs: list[dict[str, Any]] | None = None  # its tokens' records (logprobs.py)


@dataclass(slots=True)
class TextState:
    """The generated tokens of one sequence and the part of their text already streamed.

    Text that could still turn out to be the start of a stop string, or an incomplete
    UTF-8 character, is held back until it is settled, so no streamed text is ever taken
    back."""

    params: SamplingParams
    eos_ids: frozenset[int]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    prefix: int = 0  # the decode window's start (tokens)
    read: int = 0  # tokens whose text is in `text`
    stops: StopStrings | None = field(init=False)  # matched in `text` as it grows; or none
    stop_at: int | None = None  # where the first stop string in `text` starts

    def __post_init__(self) -> None:
        self.stops = StopStrings(self.params.stop) if self.params.stop else None

    def append(self, seq_id: str, token: int, decode: Decode) -> Delta:
        self.generated.append(token)
        reason = None
        if token in self.eos_ids:
            reason = "stop"
            self.flush(decode, len(self.generated) - 1)  # the EOS token's own text is not
        else:
            self._read(decode, len(self.generated),
                       flush=len(self.generated) >= self.params.max_new_tokens)
            if self.stop_at is not None:
                self.text, reason = self.text[:self.stop_at], "stop"
        if reason is None and len(self.generated) >= self.params.max_new_tokens:
            reason = "length"
        held = 0 if reason or self.stops is None else self.stops.held_back()
        visible = len(self.text) - held
        delta = Delta(seq_id, self.text[self.sent_chars:visible],
                      self.generated[self.sent_tokens:], reason)
        if delta.text or reason:
            self.sent_chars, self.sent_tokens = max(visible, self.sent_chars), len(self.generated)
        else:
            delta.token_ids = []
        return delta

    def flush(self, decode: Decode, end: int | None = None) -> None:
        """Add the text of every unread token (up to `end`) as it decodes, an incomplete
        character included: the sequence ends (finished, cancelled or stopped)."""
        self._read(decode, len(self.generated) if end is None else end, flush=True)

    def _read(self, decode: Decode, end: int, flush: bool = False) -> None:
        """Add the text of the unread tokens up to `end`, unless it ends in an incomplete
        character and this is not a flush."""
        if end <= self.read:
            return
        window = decode(self.generated[self.prefix:end])
        known = decode(self.generated[self.prefix:self.read]) if self.read > self.prefix \
            else ""
        if len(window) > len(known) and (flush or not window.endswith(REPLACEMENT)):
            self._add(window[len(known):])
            self.prefix = max(self.prefix, self.read - CONTEXT_TOKENS)
            self.read = end

    def resume(self, tokens: Sequence[int], sent_text: str, decode: Decode) -> str | None:
        """Continue after `tokens` whose text `sent_text` was streamed already (a request
        taken over after a crash); returns the finish reason if they had ended it."""
        self.generated, self.sent_tokens = list(tokens), len(tokens)
        self.sent_chars, self.read = len(sent_text), len(tokens)
        self._restart(decode(self.generated))
        if tokens and tokens[-1] in self.eos_ids:
            return "stop"
        if self.stop_at is not None:
            self.text = self.text[:self.stop_at]
            return "stop"
        if len(tokens) >= self.params.max_new_tokens:
            return "length"
        if self.text.endswith(REPLACEMENT):
            while self.read and self.text.endswith(REPLACEMENT):  # left unread, as by append
                self.read -= 1
                self.text = decode(self.generated[:self.read])
            self._restart(self.text)
        self.prefix = max(0, self.read - CONTEXT_TOKENS)
        return None

    def _add(self, text: str) -> None:
        """Text at the end; the first stop string it completes, if none was found before."""
        self.text += text
        if self.stops is not None and self.stop_at is None:
            self.stop_at = self.stops.feed(text)

    def _restart(self, text: str) -> None:
        """The whole text anew (a resume): its stop strings matched from its start."""
        self.text, self.stop_at = "", None
        if self.stops is not None:
            self.stops.reset()
        self._add(text)
