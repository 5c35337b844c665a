"""Wire protocol v1 without Redis: codecs, envelopes and the validation of stream entries."""

from __future__ import annotations

import json

import msgpack
import pytest

from producer import protocol, request_entry
from producer.protocol import JSON, MAX_ID_BYTES, MSGPACK
from producer.request_entry import InvalidEntry

LIMIT = 1000


def parse(**fields: bytes) -> request_entry.Request:
    return request_entry.parse_entry({k.encode(): v for k, v in fields.items()}, "ns", LIMIT)


def invalid(**fields: bytes) -> InvalidEntry:
    with pytest.raises(InvalidEntry) as caught:
        parse(**fields)
    return caught.value


def test_keys_follow_the_namespace() -> None:
    assert protocol.stream_key("redbatch", "minilm") == "redbatch:requests:minilm"
    assert protocol.reply_key("redbatch", "r1") == "redbatch:reply:r1"


def test_error_codes_are_the_documented_strings() -> None:
    assert {str(code) for code in protocol.ErrorCode} >= {
        "invalid_request", "deadline_exceeded", "model_error", "internal"}


@pytest.mark.parametrize("content_type", [MSGPACK, JSON])
def test_payload_round_trip(content_type: str) -> None:
    payload = {"text": "héllo ✓", "n": [1, 2.5, None, True]}
    assert protocol.decode(protocol.encode(payload, content_type), content_type) == payload


@pytest.mark.parametrize("data, content_type", [(b"\xc1", MSGPACK), (b"\x92\x01", MSGPACK),
                                                (b"{nope", JSON), (b"\xff", JSON)])
def test_undecodable_payload_says_why(data: bytes, content_type: str) -> None:
    with pytest.raises(ValueError, match="not valid"):
        protocol.decode(data, content_type)


@pytest.mark.parametrize("data, content_type, reason", [
    (b"[" * 100_000, JSON, "nested too deeply"), (b"\x91" * 100_000, MSGPACK, "StackError")])
def test_deeply_nested_payload_is_invalid_not_a_crash(data: bytes, content_type: str,
                                                      reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        protocol.decode(data, content_type)


@pytest.mark.parametrize("content_type", [MSGPACK, JSON])
def test_envelopes_decode_without_knowing_the_content_type(content_type: str) -> None:
    ok = protocol.success_envelope("a", {"x": 1}, {"model": "m"})
    failed = protocol.error_envelope("b", protocol.ErrorCode.MODEL_ERROR, "boom")
    for envelope in (ok, failed):
        assert protocol.decode_envelope(protocol.encode(envelope, content_type)) == envelope
    assert failed["error"] == {"code": "model_error", "message": "boom"}


def test_decode_envelope_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="not a redbatch envelope"):
        protocol.decode_envelope(json.dumps({"id": "x"}).encode())


def test_entry_fields_leave_defaults_out() -> None:
    assert request_entry.entry_fields("r1", b"p") == {"id": "r1", "payload": b"p"}
    assert request_entry.entry_fields("r1", b"p", content_type=JSON, reply_to="k", deadline_ms=5,
                                      priority=2) == {
        "id": "r1", "payload": b"p", "content_type": JSON, "reply_to": "k",
        "deadline_ms": 5, "priority": 2}


def test_minimal_entry_gets_the_defaults() -> None:
    request = parse(id=b"r1", payload=b"\x80")
    assert request == request_entry.Request("r1", b"\x80", MSGPACK, "ns:reply:r1", None, 0)


def test_all_fields_are_read() -> None:
    request = parse(id=b"r1", payload=b"{}", content_type=JSON.encode(),
                    reply_to=b"ns:reply:mine", deadline_ms=b"1700000000000", priority=b"-3")
    assert request == request_entry.Request("r1", b"{}", JSON, "ns:reply:mine", 1700000000000, -3)


@pytest.mark.parametrize("fields, reason", [
    ({"payload": b"x"}, "no 'id'"),
    ({"id": b"", "payload": b"x"}, "no 'id'"),
    ({"id": b"\xff\xfe", "payload": b"x"}, "not UTF-8"),
    ({"id": b"i" * (MAX_ID_BYTES + 1), "payload": b"x"}, "longer than 256 bytes"),
])
def test_entries_without_a_usable_id_cannot_be_answered(fields: dict[str, bytes],
                                                        reason: str) -> None:
    error = invalid(**fields)
    assert reason in str(error)
    assert not error.answerable


def test_an_id_of_exactly_256_bytes_is_accepted() -> None:
    assert parse(id=b"i" * MAX_ID_BYTES, payload=b"x").id == "i" * MAX_ID_BYTES


@pytest.mark.parametrize("fields, reason, reply_content_type, details", [
    ({"content_type": b"text/csv", "payload": b"x"}, "unknown content_type", JSON,
     {"field": "content_type"}),
    ({}, "no 'payload'", MSGPACK, {"field": "payload"}),
    ({"payload": b"x" * (LIMIT + 1)}, "above the limit", MSGPACK,
     {"field": "payload", "reason": "payload_too_large"}),
    ({"payload": b"x", "deadline_ms": b"soon"}, "'deadline_ms' must be an integer", MSGPACK,
     {"field": "deadline_ms"}),
    ({"payload": b"x", "priority": b"1.5"}, "'priority' must be an integer", MSGPACK,
     {"field": "priority"}),
    ({"payload": b"x", "content_type": JSON.encode(), "priority": b"high"}, "'priority'", JSON,
     {"field": "priority"}),
])
def test_malformed_entries_with_an_id_are_answered(fields: dict[str, bytes], reason: str,
                                                   reply_content_type: str,
                                                   details: dict[str, str]) -> None:
    error = invalid(id=b"r1", reply_to=b"ns:reply:back", **fields)
    assert reason in str(error)
    assert (error.request_id, error.reply_to) == ("r1", "ns:reply:back")
    assert error.content_type == reply_content_type
    assert error.details == details


def test_msgpack_payload_bytes_are_kept_encoded() -> None:
    payload = msgpack.packb({"text": "hi"})
    assert parse(id=b"r1", payload=payload).payload == payload
