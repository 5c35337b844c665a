"""worker/models/ascii_tokenizer.py: ASCII text skips the Rust normalizer, with the same ids as
MiniLM's whole tokenizer gives, on real text and on every ASCII character."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.rigs.paths import REPO_ROOT
from worker.models.ascii_tokenizer import BatchTokenizer
from worker.models.encoder import load_tokenizer
from worker.models.minilm import MAX_SEQ_LENGTH, bundled_model_path

SENTENCES = REPO_ROOT / "examples" / "sentences.txt"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(bundled_model_path(), MAX_SEQ_LENGTH)


def whole(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch_fast(texts)]


def tricky_texts() -> list[str]:
    """Every ASCII character, alone and between letters; control characters, specials
    (matched before normalising, case-sensitively), non-ASCII, truncation."""
    every = [chr(code) for code in range(128)]
    rng = random.Random(31)
    mixed = ["".join(rng.choice(every) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    return [*every, *(f"ab{c}cD" for c in every), *mixed, "", "Hello [MASK] world",
            "hello [mask] World", "[CLS] [SEP] [PAD] [UNK]", "x[UNK]y", "Tab\tNew\nline\r\x0b\x0c",
            "NUL\x00in\x7fthe\x1fmiddle", "Café déjà vu", "naïve", "中文 text", "Ünïcödé",
            "word " * 400, "WORD-" * 300]


def test_the_ids_are_the_whole_tokenizers(tokenizer: Any) -> None:
    texts = [*SENTENCES.read_text().splitlines(), *tricky_texts()]
    batch = BatchTokenizer(tokenizer)
    assert batch.bare is not None, "MiniLM's normalizer is a BertNormalizer: the path applies"
    assert batch.ids_many(texts) == whole(tokenizer, texts)


def test_only_plain_ascii_takes_the_fast_path(tokenizer: Any) -> None:
    batch = BatchTokenizer(tokenizer)
    assert batch.plain("Hello,\tWorld\x00!") == "hello, world!"
    assert batch.plain("Café") is None
    assert batch.plain("a [MASK] b") is None and batch.plain("a [mask] b") is None
    assert batch.ids_many([]) == []


def test_a_tokenizer_without_a_bert_normalizer_goes_through_whole(tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    other = Tokenizer.from_str(tokenizer.to_str())
    other.normalizer = None
    batch = BatchTokenizer(other)
    assert batch.bare is None
    assert batch.ids_many(["Mixed Case", "ok"]) == whole(other, ["Mixed Case", "ok"])
