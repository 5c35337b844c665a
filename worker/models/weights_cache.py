"""A converted checkpoint kept on disk, so that a restart skips the conversion.

transformers dequantises every tensor of a GGUF file on each load (SmolLM2: ~17 s of a
~29 s start on a CPU, plus ~7 s reading the tokenizer and config out of the GGUF). The
converted checkpoint (config, tokenizer and weights as safetensors, save_pretrained's
layout) is written once to `<cache_dir>/checkpoints/<key>/` and loaded from there later.

The key is the source file's full SHA-256 (0.12 s for SmolLM2's 98 MB; unlike size and
mtime it cannot match a changed file, and it needs no remembered state), the dtype and the
transformers version (whose conversion made the weights). An entry is written in a
temporary directory and renamed into place, so a reader never sees half of one; its
manifest holds the SHA-256 of each file, checked on load, so a truncated or corrupted entry
is ignored (one log line) and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from safetensors.torch import save_model

log = structlog.get_logger("redbatch.weights_cache")
MANIFEST = "redbatch-cache.json"
WEIGHTS = "model.safetensors"  # the name from_pretrained looks for
CHUNK = 1 << 20
Loaded = tuple[Any, Any]  # (tokenizer, model)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/redbatch, else ~/.cache/redbatch (the XDG base directory default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "redbatch"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def entry_dir(cache_dir: Path, source: Path, dtype: str) -> Path:
    """Where the conversion of `source` to `dtype` by this transformers version lives."""
    import transformers

    key = f"{source.stem}-{file_sha256(source)[:32]}-{dtype}-tf{transformers.__version__}"
    return cache_dir / "checkpoints" / key


def load_or_convert(cache_dir: Path, source: Path, dtype: str,
                    convert: Callable[[], Loaded], load: Callable[[Path], Loaded]) -> Loaded:
    """`load` the cached conversion of `source`, else `convert` it and cache the result."""
    entry = entry_dir(cache_dir, source, dtype)
    if entry.is_dir():
        try:
            verify(entry)
            loaded = load(entry)
            log.info("model.cache_hit", path=str(entry))
            return loaded
        except Exception as exc:  # a partial, corrupted or foreign entry: convert again
            log.warning("model.cache_unreadable", path=str(entry), action="rewriting",
                        error=f"{type(exc).__name__}: {exc}")
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer, model = convert()
    try:
        write(entry, tokenizer, model)
        log.info("model.cache_written", path=str(entry))
    except Exception as exc:  # a read-only or full disk costs the next start time, no more
        log.warning("model.cache_not_written", path=str(entry), error=str(exc))
    return tokenizer, model


def write(entry: Path, tokenizer: Any, model: Any) -> None:
    """save_pretrained into a temporary sibling, a manifest of hashes, then one rename."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        tokenizer.save_pretrained(staging)
        # save_pretrained refuses a model loaded from GGUF ("quantized"): its parts instead
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        save_model(model, str(staging / WEIGHTS))  # tied tensors stored once
        hashes = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / MANIFEST).write_text(json.dumps(hashes, indent=1))
        try:
            staging.rename(entry)
        except OSError:
            if not entry.is_dir():  # else another process wrote the same entry first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def verify(entry: Path) -> None:
    """Raise ValueError unless every file of the manifest is there with its hash."""
    hashes = json.loads((entry / MANIFEST).read_text())
    for name, expected in hashes.items():
        if file_sha256(entry / name) != expected:
            raise ValueError(f"{name} does not match its hash")
