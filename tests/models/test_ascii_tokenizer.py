"""worker/models/ascii_tokenizer.py: ASCII text skips the Rust normalizer, with the same ids as
MiniLM's whole tokenizer gives, on real text and on every ASCII character."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.rigs.paths import REPO_ROOT
from tests.rigs.tiny_encoders import Recording
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


def random_ascii_texts(count: int, seed: int) -> list[str]:
    """Word-like runs of letters, digits and punctuation between spaces, of every length."""
    rng = random.Random(seed)
    alphabet = [chr(code) for code in range(32, 127)]
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(500)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def test_the_word_piece_cache_gives_the_whole_tokenizers_ids(tokenizer: Any) -> None:
    batch = BatchTokenizer(tokenizer)
    assert batch.words is not None, "MiniLM is BERT WordPiece: the word cache applies"
    texts = random_ascii_texts(1000, 7)
    first, again = batch.ids_many(texts), batch.ids_many(texts)  # learning, then all cached
    assert first == again == whole(tokenizer, texts)
    assert batch.words.cache, "seen words are cached"


def test_the_cache_is_bounded_and_long_words_are_not_kept(tokenizer: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.models import ascii_tokenizer

    monkeypatch.setattr(ascii_tokenizer, "CACHED_WORDS", 50)
    batch = BatchTokenizer(tokenizer)
    assert batch.words is not None
    texts = [*random_ascii_texts(200, 8), "supercalifragilisticexpialidocious" * 3]
    assert batch.ids_many(texts) == whole(tokenizer, texts)  # words past the bound still right
    assert len(batch.words.cache) <= 50
    assert not any(len(word) > ascii_tokenizer.CACHED_WORD_CHARS for word in batch.words.cache)


def test_short_truncation_is_kept(tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    short = Tokenizer.from_str(tokenizer.to_str())
    short.enable_truncation(8)
    batch = BatchTokenizer(short)
    assert batch.words is not None
    texts = ["one two three four five six seven eight nine", "a b", "tokenization unaffable x"]
    assert batch.ids_many(texts) == whole(short, texts)
    short.enable_truncation(8, direction="left")  # kept from the end: the tokenizer's own
    batch = BatchTokenizer(short)
    assert batch.words is None and batch.ids_many(texts) == whole(short, texts)


def test_another_pre_tokenizer_keeps_the_tokenizers_split(tokenizer: Any) -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    other = Tokenizer.from_str(tokenizer.to_str())
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "it's," is one word here
    batch = BatchTokenizer(other)
    assert batch.bare is not None and batch.words is None
    texts = ["it's, a test.", *random_ascii_texts(50, 9)]
    assert batch.ids_many(texts) == whole(other, texts)


def test_a_megabyte_of_text_is_tokenised_as_its_reachable_part(tokenizer: Any) -> None:
    """A text is cut to what truncation could keep before tokenising (a hostile megabyte cost
    every request of its read seconds): real text keeps the whole tokenizer's ids, and the
    word cache learns no word past the truncation."""
    from worker.models import ascii_tokenizer

    batch = BatchTokenizer(tokenizer)
    assert batch.words is not None
    rng = random.Random(5)
    novel = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
                     for _ in range(120_000))  # ~1 MiB of words seen nowhere
    real = [SENTENCES.read_text() * 30, "Café déjà vu, naïve 中文. " * 40_000]
    assert all(len(text) > 256 * ascii_tokenizer.CHARS_PER_TOKEN for text in [*real, novel])
    assert batch.ids_many(real) == whole(tokenizer, real)
    known = len(batch.words.cache)
    assert batch.ids_many([novel]) == whole(tokenizer, [novel])
    assert len(batch.words.cache) - known <= MAX_SEQ_LENGTH, "only the words truncation keeps"


def test_left_truncation_keeps_the_end(tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    left = Tokenizer.from_str(tokenizer.to_str())
    left.enable_truncation(8, direction="left")
    text = "first words " + "filler " * 10_000 + "the very last words"
    assert BatchTokenizer(left).ids_many([text]) == whole(left, [text])


def test_the_tokenizer_is_given_only_what_truncation_could_keep(tokenizer: Any) -> None:
    from worker.models import ascii_tokenizer

    recording = Recording(tokenizer)
    text = "中文 text, naïve. " * 60_000  # not plain ASCII: the whole tokenizer's path
    assert BatchTokenizer(recording).ids_many([text]) == whole(tokenizer, [text])
    assert 0 < recording.longest <= MAX_SEQ_LENGTH * ascii_tokenizer.CHARS_PER_TOKEN
