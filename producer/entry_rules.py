"""What a worker accepts of a request entry, before any work on it: its size, the size of
its decoded payload and whether its JSON holds whole characters, and where it may be
answered (docs/protocol.md, "Limits").

A producer that can only XADD must not be able to make a worker write, expire or create
any key but the reply keys: a list reply goes under `<ns>:reply:`, a streamed one under
`<ns>:stream:` (or under prefixes a `reply_prefixes` setting adds). Pure: no I/O.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_REPLY_TO_BYTES = 512  # room for a namespace, a shard tag and a 256-byte id
MAX_ENTRY_FIELDS = 16  # the six of the protocol and a few of a producer's own
ENTRY_OVERHEAD_BYTES = 16384  # what the fields other than `payload` may add up to
MAX_CONTAINERS = 16384  # arrays and maps in one payload: each costs ~60 bytes decoded
MAX_CONTAINER_ITEMS = 65536  # items of one msgpack array or map
# a generative payload's stop strings: the worker checks them, the gateway before enqueueing
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1000  # each; its matcher is built on the generate loop's thread


@dataclass(frozen=True, slots=True)
class EntryRules:
    """Sizes, and where a reply may go."""

    namespace: str
    max_payload_bytes: int
    reply_prefixes: tuple[str, ...] = ()  # allowed besides <ns>:reply: and <ns>:stream:

    @property
    def reply_prefix(self) -> str:
        return f"{self.namespace}:reply:"

    @property
    def stream_prefix(self) -> str:
        return f"{self.namespace}:stream:"

    def list_reply_allowed(self, key: str) -> bool:
        return key.startswith((self.reply_prefix, *self.reply_prefixes))

    def stream_reply_allowed(self, key: str) -> bool:
        return key.startswith((self.stream_prefix, *self.reply_prefixes))

    def max_entry_bytes(self) -> int:
        return self.max_payload_bytes + ENTRY_OVERHEAD_BYTES

    def reply_to_problem(self, raw: bytes) -> str | None:
        """Why a `reply_to` cannot be used, or None: too long, not UTF-8, or outside
        every reply prefix."""
        if len(raw) > MAX_REPLY_TO_BYTES:
            return f"'reply_to' is longer than {MAX_REPLY_TO_BYTES} bytes"
        try:
            reply_to = raw.decode()
        except UnicodeDecodeError:
            return "field 'reply_to' is not UTF-8"
        if self.list_reply_allowed(reply_to) or self.stream_reply_allowed(reply_to):
            return None
        return (f"'reply_to' must start with {self.reply_prefix!r} or "
                f"{self.stream_prefix!r}")

    def size_problem(self, fields: dict[bytes, bytes]) -> str | None:
        """Why an entry is too large to look at, or None."""
        if len(fields) > MAX_ENTRY_FIELDS:
            return f"entry has {len(fields)} fields, above the limit of {MAX_ENTRY_FIELDS}"
        size = sum(len(k) + len(v) for k, v in fields.items())
        if size > self.max_entry_bytes():
            return f"entry is {size} bytes, above the limit of {self.max_entry_bytes()}"
        return None

    def misdirected_message(self, streamed: bool) -> str:
        if streamed:
            return f"a streamed answer's 'reply_to' must start with {self.stream_prefix!r}"
        return f"a list reply's 'reply_to' must start with {self.reply_prefix!r}"


@functools.lru_cache(maxsize=64)
def rules_for(namespace: str, max_payload_bytes: int,
              reply_prefixes: tuple[str, ...] = ()) -> EntryRules:
    """The rules of one worker's settings, built once (parse_entry runs for every request)."""
    return EntryRules(namespace, max_payload_bytes, reply_prefixes)


class ContainerCount:
    """Counts the arrays and maps a decoder builds (its object and list hook), and stops
    it past MAX_CONTAINERS: an empty map is one byte of msgpack and about 70 bytes in
    Python, so 1 MiB could become 72 MiB before any model looks at it."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} arrays and maps")
        return container

    def with_arrays(self, obj: Any, data: bytes) -> Any:
        """Decoded JSON (`data`), its arrays counted too: json has an object hook (this)
        but none for arrays, and '[[],[],...' makes 23 MB of lists of 1 MiB. Each array
        takes two bytes at least and opens with a '[' byte, so a payload of no more than
        twice, or with no more '[' than, the maps left room for fits (a short one is not
        even counted): only one with more (or with '[' in its strings) is walked, in full."""
        if len(data) <= 2 * self.left or data.count(b"[") <= self.left:
            return obj
        counted, stack = ContainerCount(), [obj] if isinstance(obj, list | dict) else []
        while stack:  # iterative, for deep nesting; stops at the first container too many
            container = counted(stack.pop())
            items = container.values() if isinstance(container, dict) else container
            stack += [item for item in items if isinstance(item, list | dict)]
        return obj


# In JSON's bytes, a UTF-16 surrogate escaped (\ud800-\udfff) or encoded as UTF-8 (ED A0-BF)
SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def whole_characters(obj: Any, data: bytes) -> Any:
    """Decoded JSON, unless a string in it holds half of a UTF-16 surrogate pair: JSON can
    say "\\ud800" (and Python reads a UTF-8-encoded surrogate), but no text can hold one,
    and a tokenizer fails on it. Only a payload with a surrogate in it (a whole pair, as
    Python's json.dumps escapes an emoji, is one too) is checked: encoded again, in C."""
    if SURROGATE.search(data) is not None:
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("payload is not valid JSON text: a string holds an unpaired "
                             "UTF-16 surrogate (\\ud800-\\udfff)") from None
    return obj
