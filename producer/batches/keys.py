"""Ids and key names of files and batches. Pure.

A batch's state, reply list, output and error lines share the hash tag `{<batch id>}`, so
a Redis Cluster keeps them in one slot and every change to them is one script. An uploaded
file's keys share `{<file id>}`; a batch's output and error files live in the batch's slot
(their ids name the batch), so finishing a batch writes them in the same script.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import uuid

OUTPUT_FILE = re.compile(r"file-(batch_[0-9a-f]{24})-(output|errors)")
FILE_ID = re.compile(r"file-[0-9a-f]{24}")


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def holder_name(role: str) -> str:
    """A batch runner's lease holder: unique, and saying which process holds a batch."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def batch_id_for(owner: str, idempotency_key: str) -> str:
    """The batch id of a create with an Idempotency-Key: the same for a repeat, so the
    repeat finds the first batch in its own slot."""
    digest = hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()
    return f"batch_{digest[:24]}"


def owner_of(api_key: str | None) -> str:
    """Whose batches and files these are: a digest of the caller's key (never the key)."""
    if not api_key:
        return "public"
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def is_file_id(file_id: str) -> bool:
    return bool(FILE_ID.fullmatch(file_id) or OUTPUT_FILE.fullmatch(file_id))


def output_file_id(batch_id: str, kind: str) -> str:
    """`kind`: output or errors."""
    return f"file-{batch_id}-{kind}"


class BatchKeys:
    """Every key of one batch, in its slot."""

    def __init__(self, namespace: str, batch_id: str) -> None:
        base = f"{namespace}:batch:{{{batch_id}}}"
        self.meta = base
        self.done = f"{base}:done"  # a bitmap: line n answered
        self.flight = f"{base}:flight"  # line -> attempt, for lines admitted, not answered
        self.deferred = f"{base}:deferred"  # line -> when to admit it again (overloaded)
        self.parts = f"{base}:parts"  # request id -> envelope, of lines of several requests
        self.order = f"{base}:order"  # the line numbers in admission order (uint32 LE each)
        self.output = f"{base}:output"
        self.errors = f"{base}:errors"
        self.lease = f"{base}:lease"
        self.reply = f"{namespace}:reply:{{{batch_id}}}"  # the workers' replies
        self.output_meta = f"{namespace}:file:{{{batch_id}}}:output"
        self.errors_meta = f"{namespace}:file:{{{batch_id}}}:errors"

    def all(self) -> list[str]:
        return [self.meta, self.done, self.flight, self.deferred, self.parts, self.output,
                self.errors, self.lease, self.reply, self.output_meta, self.errors_meta,
                self.order]


def file_index(namespace: str, owner: str) -> str:
    """A sorted set of an owner's uploaded files, by creation time."""
    return f"{namespace}:files:{{{owner}}}"


def batch_index(namespace: str, owner: str) -> str:
    """A sorted set of an owner's batches, by creation time."""
    return f"{namespace}:batches:{{{owner}}}"


def active_batches(namespace: str) -> str:
    """A sorted set of the batches not yet final, for runners to find."""
    return f"{namespace}:batches:active"


def file_keys(namespace: str, file_id: str) -> tuple[str, str]:
    """(metadata hash, content): an uploaded file's content is a hash of its lines by
    index (read in windows); a batch's output file's is its list of lines."""
    found = OUTPUT_FILE.fullmatch(file_id)
    if found:
        keys = BatchKeys(namespace, found.group(1))
        if found.group(2) == "output":
            return keys.output_meta, keys.output
        return keys.errors_meta, keys.errors
    return f"{namespace}:file:{{{file_id}}}", f"{namespace}:file:{{{file_id}}}:lines"


def request_id(batch_id: str, line: int, attempt: int, part: int) -> str:
    """A line's request id: unique per attempt, so a line admitted again never meets its
    earlier attempt's id claim on the reply key."""
    return f"{batch_id}-{line}-{attempt}-{part}"


def parse_request_id(value: str) -> tuple[int, int, int] | None:
    """(line, attempt, part) of a request id made by request_id, else None."""
    parts = value.rsplit("-", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[1]), int(parts[2]), int(parts[3])
