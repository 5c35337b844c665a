"""Reply envelopes with numpy rows in them (MiniLM's embeddings), encoded without a Python
float per element.

msgpack: the envelope is packed once with a stand-in for each array, then each float32 row
is spliced in as msgpack float 64 values written by numpy (tag 0xcb, big-endian doubles):
byte for byte what packing `row.tolist()` gives, so the wire format is unchanged. Bytes (a float32
encoding) are msgpack `bin`. JSON: a row becomes a list of floats, bytes their base64 text.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from typing import Any

import msgpack
import numpy as np

from producer import protocol

_local = threading.local()  # one Packer per thread, and the arrays of its current envelope
STAND_IN_EXT = msgpack.ExtType(0x7F, os.urandom(16))  # unique per process: no payload has it
STAND_IN = msgpack.packb(STAND_IN_EXT)
FLOAT64_ELEMENT = np.dtype([("tag", "u1"), ("value", ">f8")])  # one msgpack float 64
MSGPACK_FLOAT64 = 0xCB


def encode_envelope(envelope: dict[str, Any], content_type: str) -> bytes:
    """The envelope in the request's content type, numpy rows and bytes included."""
    if content_type == protocol.JSON:
        return json.dumps(envelope, separators=(",", ":"), ensure_ascii=False,
                          default=_json_default).encode()
    state = _local.__dict__
    if "packer" not in state:
        state["packer"] = msgpack.Packer(use_bin_type=True, default=_stand_in)
    arrays: list[np.ndarray] = []
    state["arrays"] = arrays
    packed: bytes = state["packer"].pack(envelope)
    if not arrays:
        return packed
    parts = packed.split(STAND_IN)
    if len(parts) != len(arrays) + 1:  # a payload held the stand-in's 16 random bytes
        raise ValueError("an array's stand-in occurs in the envelope")
    spliced = [parts[0]]
    for array, part in zip(arrays, parts[1:], strict=True):
        spliced += (msgpack_floats(array), part)
    return b"".join(spliced)


def _stand_in(value: Any) -> Any:
    """The Packer's hook: an array is packed as a stand-in, replaced by its floats after."""
    if isinstance(value, np.ndarray):
        _local.arrays.append(value)
        return STAND_IN_EXT
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"can not serialize {type(value).__name__!r} object")


def msgpack_floats(array: np.ndarray) -> bytes:
    """A msgpack array of float 64 values: what packing `array.tolist()` gives, as floats."""
    flat = array.ravel()
    elements = np.empty(flat.size, dtype=FLOAT64_ELEMENT)
    elements["tag"] = MSGPACK_FLOAT64
    elements["value"] = flat
    return _header(flat.size, 0x90, 0xDC) + elements.tobytes()


def _header(count: int, fix: int, wide: int) -> bytes:
    """A msgpack array (fix 0x90, wide 0xdc) or map (0x80, 0xde) header for `count`."""
    if count < 16:
        return bytes([fix | count])
    if count < 1 << 16:
        return bytes([wide]) + count.to_bytes(2, "big")
    return bytes([wide + 1]) + count.to_bytes(4, "big")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
