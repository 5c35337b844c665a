"""From a window of the workers' replies to what SETTLE writes: answers, retries, parts. Pure.

A line of one request is answered by its one envelope. A line of several (an embeddings
line of many inputs, a rerank line) waits until every part of one attempt is in: parts seen
before are kept in the batch's `parts` hash and asked for (`needs_parts`) when a later part
arrives, and dropped once the line is answered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producer import protocol
from producer.batches import keys, lines
from producer.gateway import jsonio
from producer.gateway.errors import ApiError


@dataclass(slots=True)
class Settlement:
    answers: list[tuple[int, bool, bytes]] = field(default_factory=list)
    retries: list[tuple[int, int, int]] = field(default_factory=list)
    kept: list[tuple[str, bytes]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    needs_parts: list[str] = field(default_factory=list)  # request ids to read, then again


def answered_bit(bitmap: bytes, n: int) -> bool:
    """Bit `n` of a Redis bitmap (SETBIT numbers a byte's bits from its highest)."""
    return n // 8 < len(bitmap) and bool(bitmap[n // 8] >> (7 - n % 8) & 1)


def settle(batch_id: str, envelopes: Sequence[dict[str, Any] | None],
           raws: Mapping[int, bytes | None], done: bytes, max_inputs: int, created: int,
           now_ms: int, retry_ms: int, stored: Mapping[str, bytes | None] | None = None
           ) -> Settlement:
    """`envelopes`: the replies, oldest first (None: not an envelope); `raws`: the input
    lines they answer; `stored`: parts read from the `parts` hash (None on a first pass)."""
    result = Settlement()
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for envelope in envelopes:
        found = keys.parse_request_id(str((envelope or {}).get("id", "")))
        if envelope is not None and found and not answered_bit(done, found[0]):
            groups.setdefault(found[:2], {})[found[2]] = envelope
    for (line, attempt), parts in groups.items():
        try:
            parsed = lines.read_line(raws.get(line) or b"", 1 << 62)
            work = lines.work_of(parsed, max_inputs, created)
        except (ApiError, lines.LineProblem):
            continue  # the file is gone or changed: the flight timeout answers it later
        ids = [keys.request_id(batch_id, line, attempt, p) for p in range(len(work.payloads))]
        missing = [i for p, i in enumerate(ids) if p not in parts]
        if missing and stored is None:
            result.needs_parts += missing
            continue
        for p, rid in enumerate(ids):
            kept = (stored or {}).get(rid)
            if p not in parts and kept is not None:
                parts[p] = protocol.decode_envelope(kept)
        if len(parts) < len(ids):
            result.kept += [(ids[p], jsonio.dumps(e)) for p, e in parts.items()
                            if (stored or {}).get(ids[p]) is None]
            continue
        result.dropped += ids if len(ids) > 1 else []
        conclude(result, parsed, work, ids[0], line, attempt,
                 [parts[p] for p in range(len(ids))], now_ms, retry_ms)
    return result


def conclude(result: Settlement, parsed: lines.InputLine, work: lines.Work, rid: str,
             line: int, attempt: int, envelopes: list[dict[str, Any]], now_ms: int,
             retry_ms: int) -> None:
    """A line's complete envelopes: its answer, or a retry when the workers shed it."""
    outcome = lines.outcome(envelopes)
    if outcome == lines.IGNORE:
        return
    if outcome == lines.RETRY:
        after = max((int((e.get("error") or {}).get("retry_after_ms") or 0)
                     for e in envelopes), default=0)
        result.retries.append((line, attempt, now_ms + (after or retry_ms)))
        return
    if outcome == lines.EXPIRE:
        result.answers.append((line, False, jsonio.dumps(lines.unanswered(
            parsed.custom_id, rid, *lines.EXPIRED))))
        return
    ok, out = lines.output_of(parsed, work, rid, envelopes)
    result.answers.append((line, ok, jsonio.dumps(out)))


def envelopes_of(replies: Sequence[bytes]) -> tuple[list[dict[str, Any] | None], list[int]]:
    """The replies decoded (None for what is no envelope: any producer may write to a reply
    key), and the lines of this batch they answer, whose input lines settling reads."""
    envelopes = [decoded(raw) for raw in replies]
    wanted = sorted({found[0] for e in envelopes
                     if e and (found := keys.parse_request_id(str(e.get("id", ""))))})
    return envelopes, wanted


def decoded(raw: bytes) -> dict[str, Any] | None:
    try:
        return protocol.decode_envelope(raw)
    except Exception:  # not an envelope
        return None
