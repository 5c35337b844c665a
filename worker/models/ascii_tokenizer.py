"""Token ids for a read's texts, with a faster path for ASCII text through a BERT tokenizer.

The Rust tokenizer's BertNormalizer keeps an alignment per character through each of its
steps (clean, split Chinese characters, NFD and accent stripping, lowercase): on MiniLM that
is about 45 % of the tokenising CPU for English sentences (55 -> 30 µs a text, issue 31),
the largest cost of the host path. On ASCII text those steps reduce to dropping control
characters, turning tab, newline and return into spaces, and lowercasing: str.translate and
str.lower do that in C. Any other text (non-ASCII, or holding a special token such as `[MASK]`,
matched before normalising) goes to the tokenizer as it is.

What is left of the Rust tokenizer on such text is still ~30 µs a text (the pre-tokenizer's
per-character alignments, one Encoding of nine arrays per text), while splitting cleaned
ASCII into words and punctuation is one regular expression. So a BERT WordPiece tokenizer's
plain texts are split here and their words looked up in a bounded cache of word pieces
(`WordPieces`, hand-written: ~5 µs a text); only words not seen before go to the tokenizer,
in one batch call per read. Without that layout, plain texts go to a copy of the tokenizer
with no normalizer in one batch call. The ids are the same either way: `WordPieces` checks
itself against the tokenizer when it is built, and tests/models/test_ascii_tokenizer.py
compares every path on real text, every ASCII character and random ASCII.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

# BertNormalizer's clean_text on ASCII: NUL and other control characters (Cc) are dropped,
# except tab, newline and return, which are whitespace and become spaces
CONTROLS: dict[int, str | None] = {
    **{code: None for code in (*range(0x20), 0x7F)}, 0x09: " ", 0x0A: " ", 0x0D: " "}
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a search is cheaper than translating every text
# BertPreTokenizer on cleaned ASCII (printable characters and spaces): runs of letters and
# digits are words; every other printable character is punctuation, a word of its own
WORD = re.compile(r"[A-Za-z0-9]+|[^ A-Za-z0-9]")
CACHED_WORDS = 1 << 18  # bounds what a stream of novel words can hold (tens of MB at most)
CACHED_WORD_CHARS = 40  # longer words are rare: looked up each time, never cached
# A text is cut to this many characters per token of the tokenizer's limit before tokenising:
# the rest is truncated away anyway, and a megabyte of text would cost every other request of
# the read seconds. Real text averages 3-6 characters a token; only runs of whitespace or
# dropped characters, or words over WordPiece's 100 characters, could reach past the cut.
CHARS_PER_TOKEN = 32
# texts the cache must reproduce exactly before it is used: punctuation, digits, case,
# word-piece splits, a word past WordPiece's 100 characters, truncation
PROBES = ("Hello, world! It's 3.14 -- (really) [sic]; a_b~c`d{e}f|g^h@i#j$k%l&m*n+o=p<q>r?s/t",
          "unaffable tokenization of antidisestablishmentarianism", "x" * 120, "",
          " ".join(f"w{n}ord." for n in range(300)))


class WordPieces:
    """Token ids of cleaned ASCII texts from a cache of each word's word pieces, for a
    tokenizer that splits as BertPreTokenizer, cuts words with WordPiece, and wraps a text as
    `first + pieces + last` (BERT's [CLS] ... [SEP]), truncated on the right."""

    def __init__(self, pieces: Any, first: list[int], last: list[int],
                 max_length: int | None) -> None:
        self.pieces = pieces  # the tokenizer's words to ids: no normalizer, no specials
        self.first, self.last = first, last
        self.body = None if max_length is None else max_length - len(first) - len(last)
        self.cache: dict[str, list[int]] = {}

    @classmethod
    def of(cls, bare: Any, config: dict[str, Any]) -> WordPieces | None:
        """For a normalizer-free copy of a BERT tokenizer; None where its layout differs or
        the cache would not give its ids on the probes."""
        from tokenizers import Tokenizer

        truncation = bare.truncation
        if ((config.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
                or config["model"].get("type") != "WordPiece"
                or (truncation or {}).get("direction", "right") != "right"):
            return None
        wrapped = bare.encode("").ids
        pieces = Tokenizer.from_str(bare.to_str())
        pieces.post_processor = None
        pieces.no_truncation()
        words = cls(pieces, wrapped[:1], wrapped[1:],
                    truncation["max_length"] if truncation else None)
        expected = [encoding.ids for encoding in bare.encode_batch_fast(list(PROBES))]
        return words if words.ids_many(list(PROBES)) == expected else None

    def ids_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Each cleaned ASCII text's ids; the words not cached are worked out in one call.
        Only a text's first `body` words are looked at: each is at least one piece."""
        split = [WORD.findall(text)[:self.body] for text in texts]
        out: list[list[int] | None] = [self._wrap(words, self.cache.__getitem__)
                                       for words in split]
        missed = [n for n, ids in enumerate(out) if ids is None]
        if missed:
            found = self._learn({w for n in missed for w in split[n]})
            for n in missed:
                out[n] = self._wrap(split[n], found.__getitem__)
        return out  # type: ignore[return-value]  # every None was filled

    def _wrap(self, words: list[str], pieces_of: Callable[[str], list[int]]) -> list[int] | None:
        """The text's ids, or None if a word is not known."""
        try:
            ids = [*self.first, *chain.from_iterable(map(pieces_of, words))]
        except KeyError:
            return None
        if self.body is not None and len(ids) > len(self.first) + self.body:
            del ids[len(self.first) + self.body:]
        ids += self.last
        return ids

    def _learn(self, words: set[str]) -> dict[str, list[int]]:
        """The pieces of these words (cached, as far as the cache's bounds allow)."""
        new = [word for word in words if word not in self.cache]
        found = {word: self.cache[word] for word in words if word in self.cache}
        encodings = self.pieces.encode_batch_fast(new, add_special_tokens=False) if new else []
        for word, encoding in zip(new, encodings, strict=True):
            found[word] = encoding.ids
            if len(word) <= CACHED_WORD_CHARS and len(self.cache) < CACHED_WORDS:
                self.cache[word] = encoding.ids
        return found


class BatchTokenizer:
    """`ids_many(texts)`: each text's token ids, in order, from one or two batch calls."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.reachable = reachable(tokenizer)
        self.bare: Any = None  # the tokenizer without its normalizer, when the path applies
        self.words: WordPieces | None = None  # its word-piece cache, where that applies
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
        # cleaned text is printable ASCII; text matched to added tokens after normalising
        # (there are none in BERT's) would need the tokenizer's own split
        if self.table is not None and not any(
                token.get("normalized", True) for token in config.get("added_tokens", [])):
            self.words = WordPieces.of(self.bare, config)

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
        texts = [text[self.reachable] for text in texts]
        if self.bare is None:
            return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts)]
        plain = [self.plain(text) for text in texts]
        fast = [text for text in plain if text is not None]
        slow = [text for text, done in zip(texts, plain, strict=True) if done is None]
        if self.words is not None:
            fast_ids: Any = iter(self.words.ids_many(fast))
        else:
            fast_ids = iter(encoding.ids for encoding in self.bare.encode_batch_fast(fast))
        slow_ids = iter(encoding.ids for encoding in self.tokenizer.encode_batch_fast(slow))
        return [next(fast_ids if done is not None else slow_ids) for done in plain]


def reachable(tokenizer: Any) -> slice:
    """The part of a text the tokenizer is given: CHARS_PER_TOKEN per token of its truncation
    length, from the end it keeps; all of it where it does not truncate."""
    truncation = tokenizer.truncation
    if not truncation:
        return slice(None)
    chars = truncation["max_length"] * CHARS_PER_TOKEN
    return slice(-chars, None) if truncation.get("direction") == "left" else slice(chars)
