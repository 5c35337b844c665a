"""How an embedding travels in a reply: a list of floats (the default), or with the payload
option `"encoding": "float32"` its little-endian float32 bytes (msgpack `bin`, a base64
string in a JSON reply): 1.5 KB instead of 3.5 KB for 384 dimensions, and nothing to parse
element by element on either side. See docs/protocol.md, "Embedding encodings".
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from producer import protocol

FLOAT_LIST = "float"
FLOAT32 = "float32"
ENCODINGS = (FLOAT_LIST, FLOAT32)
LITTLE_FLOAT32 = np.dtype("<f4")


def as_float32_bytes(vector: Any) -> bytes:
    """A vector (numpy array, list of floats) as little-endian float32 bytes."""
    return np.ascontiguousarray(vector, dtype=LITTLE_FLOAT32).tobytes()


def from_float32(data: bytes | str) -> np.ndarray:
    """The vector of float32 bytes, or of their base64 text (a JSON reply)."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    if len(raw) % LITTLE_FLOAT32.itemsize:
        raise ValueError(f"float32 embedding of {len(raw)} bytes is not a whole vector")
    return np.frombuffer(raw, dtype=LITTLE_FLOAT32).astype(np.float32)


def decode_embedding(value: Any, as_numpy: bool = False) -> Any:
    """An `embedding` as a list of floats, or as a float32 numpy array with `as_numpy`,
    whichever encoding it came in (anything else is returned as it is)."""
    if isinstance(value, bytes | bytearray | str):
        vector = from_float32(bytes(value) if isinstance(value, bytearray) else value)
        return vector if as_numpy else vector.tolist()
    if as_numpy and isinstance(value, list):
        return np.asarray(value, dtype=np.float32)
    return value


def decode_result(result: Any, as_numpy: bool = False) -> Any:
    """A result with its `embedding` decoded (decode_embedding); other results unchanged."""
    if isinstance(result, dict) and "embedding" in result:
        embedding = result["embedding"]
        if as_numpy or not isinstance(embedding, list):
            try:
                return {**result, "embedding": decode_embedding(embedding, as_numpy)}
            except ValueError:  # not an encoded vector (an echoed payload): left as it is
                return result
    return result


def decode_reply(data: bytes, as_numpy: bool = False) -> dict[str, Any]:
    """A reply envelope (protocol.decode_envelope), its result's embedding decoded."""
    return with_embedding(protocol.decode_envelope(data), as_numpy)


def with_embedding(envelope: dict[str, Any], as_numpy: bool = False) -> dict[str, Any]:
    """The envelope, its result's embedding decoded: a list of floats, or a float32 numpy
    array with `as_numpy` (the clients' `wait` and `collect`)."""
    if envelope.get("ok") and "result" in envelope:
        envelope["result"] = decode_result(envelope["result"], as_numpy)
    return envelope
