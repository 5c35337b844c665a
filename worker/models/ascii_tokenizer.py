"""Token ids for a read's texts, with a faster path for ASCII text through a BERT tokenizer.

The Rust tokenizer's BertNormalizer keeps an alignment per character through each of its
steps (clean, split Chinese characters, NFD and accent stripping, lowercase): on MiniLM that
is about 45 % of the tokenising CPU for English sentences (55 -> 30 µs a text, issue 31),
the largest cost of the host path. On ASCII text those steps reduce to dropping control
characters, turning tab, newline and return into spaces, and lowercasing: str.translate and
str.lower do that in C. Such texts go, in one batch call, to a copy of the tokenizer with no
normalizer; any other text (non-ASCII, or holding a special token such as `[MASK]`, matched
before normalising) to the tokenizer as it is. The ids are the same
(tests/models/test_ascii_tokenizer.py compares both on real text and every ASCII character).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

# BertNormalizer's clean_text on ASCII: NUL and other control characters (Cc) are dropped,
# except tab, newline and return, which are whitespace and become spaces
CONTROLS: dict[int, str | None] = {
    **{code: None for code in (*range(0x20), 0x7F)}, 0x09: " ", 0x0A: " ", 0x0D: " "}
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a search is cheaper than translating every text


class BatchTokenizer:
    """`ids_many(texts)`: each text's token ids, in order, from one or two batch calls."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bare: Any = None  # the tokenizer without its normalizer, when the path applies
        self.table: dict[int, str | None] | None = None
        self.lowercase = False
        self.specials: re.Pattern[str] | None = None
        config = json.loads(tokenizer.to_str())
        normalizer = config.get("normalizer") or {}
        if normalizer.get("type") != "BertNormalizer":
            return
        from tokenizers import Tokenizer

        self.bare = Tokenizer.from_str(tokenizer.to_str())
        self.bare.normalizer = None
        self.table = CONTROLS if normalizer.get("clean_text", True) else None
        self.lowercase = bool(normalizer.get("lowercase", True))
        # added tokens matched before normalising, lowered: a text holding one goes whole
        specials = [re.escape(token["content"].lower()) for token in config.get("added_tokens", [])
                    if not token.get("normalized", True)]
        self.specials = re.compile("|".join(specials)) if specials else None

    def plain(self, text: str) -> str | None:
        """The text as the normalizer would leave it, if it is ASCII with no special token
        in it; None: it goes through the whole tokenizer."""
        if not text.isascii():
            return None
        lowered = text.lower()
        if self.specials is not None and self.specials.search(lowered):
            return None
        cleaned = lowered if self.lowercase else text
        if self.table is not None and CONTROL.search(cleaned):
            return cleaned.translate(self.table)
        return cleaned

    def ids_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (special tokens added, truncated as the tokenizer is)."""
        if not texts:
            return []
        if self.bare is None:
            return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts)]
        plain = [self.plain(text) for text in texts]
        fast = [text for text in plain if text is not None]
        slow = [text for text, done in zip(texts, plain, strict=True) if done is None]
        fast_ids = iter(self.bare.encode_batch_fast(fast) if fast else ())
        slow_ids = iter(self.tokenizer.encode_batch_fast(slow) if slow else ())
        return [next(fast_ids if done is not None else slow_ids).ids for done in plain]
