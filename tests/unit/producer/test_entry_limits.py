"""What a worker accepts of an entry before any work on it (issue 30): a reply_to confined to
the reply prefixes, bounded entries, and payloads that cannot blow up when decoded."""

from __future__ import annotations

import gc
import json
import time

import msgpack
import pytest

from producer import entry_rules, protocol, request_entry
from producer.entry_rules import EntryRules
from producer.protocol import JSON, MSGPACK
from producer.request_entry import InvalidEntry

LIMIT = 1000


def parse(reply_prefixes: tuple[str, ...] = (), default: str | None = None,
          **fields: bytes) -> request_entry.Request:
    return request_entry.parse_entry({k.encode(): v for k, v in fields.items()}, "ns", LIMIT,
                                     reply_prefixes=reply_prefixes, default_reply=default)


def refused(**fields: bytes) -> InvalidEntry:
    with pytest.raises(InvalidEntry) as caught:
        parse(**fields)
    return caught.value


@pytest.mark.parametrize("reply_to", [
    b"ns:requests:other-model", b"ns:answered:echo", b"ns:workers:echo", b"ns:dead:echo",
    b"app:sessions", b"ns:replyX", b"NS:reply:x", b"ns:inflight:x", b"\xff",
    b"ns:reply:" + b"x" * entry_rules.MAX_REPLY_TO_BYTES])
def test_a_reply_to_outside_the_reply_prefixes_is_answered_on_the_default_key(
        reply_to: bytes) -> None:
    error = refused(id=b"r1", payload=b"x", reply_to=reply_to)
    assert error.answerable and error.reply_to == "ns:reply:r1"
    assert error.details == {"field": "reply_to"}


def test_on_a_cluster_the_default_is_the_shards_own() -> None:
    with pytest.raises(InvalidEntry) as caught:
        parse(default="ns:reply:{m:3}:r1", id=b"r1", payload=b"x", reply_to=b"elsewhere")
    assert caught.value.reply_to == "ns:reply:{m:3}:r1"


def test_reply_and_stream_prefixes_and_a_settings_own_are_accepted() -> None:
    assert parse(id=b"r1", payload=b"x", reply_to=b"ns:reply:batch-1").reply_to == \
        "ns:reply:batch-1"
    assert parse(id=b"r1", payload=b"x", reply_to=b"ns:stream:s1").reply_to == "ns:stream:s1"
    assert parse(("app:answers:",), id=b"r1", payload=b"x",
                 reply_to=b"app:answers:7").reply_to == "app:answers:7"


def test_each_kind_of_answer_goes_under_its_own_prefix() -> None:
    rules = EntryRules("ns", LIMIT)
    request = request_entry.Request("r1", b"", MSGPACK, "ns:stream:s1", default_reply="ns:reply:r1")
    assert request_entry.misdirected(request, streamed=False, rules=rules)  # a list on a stream key
    assert not request_entry.misdirected(request, streamed=True, rules=rules)
    listed = request_entry.Request("r1", b"", MSGPACK, "ns:reply:mine")
    assert request_entry.misdirected(listed, streamed=True, rules=rules)  # a stream on a list key
    default = request_entry.Request("r1", b"", MSGPACK, "ns:reply:r1")
    assert not request_entry.misdirected(default, streamed=True, rules=rules)  # -> ns:stream:r1
    sharded = request_entry.Request("r1", b"", MSGPACK, "ns:reply:{m:2}:r1")
    assert not request_entry.misdirected(sharded, streamed=True, rules=rules)


def test_too_many_fields_are_refused_before_any_work() -> None:
    extra = {f"f{n}": b"" for n in range(5000)}
    error = refused(id=b"r1", payload=b"x", **extra)
    assert error.answerable and error.details == {"reason": "entry_too_large"}
    assert "5002 fields" in str(error)


def test_the_whole_entry_is_bounded_not_only_the_payload() -> None:
    error = refused(id=b"r1", payload=b"x", junk=b"j" * (LIMIT + entry_rules.ENTRY_OVERHEAD_BYTES))
    assert error.details == {"reason": "entry_too_large"}


def test_a_huge_content_type_is_not_echoed_back() -> None:
    error = refused(id=b"r1", payload=b"x", content_type=b"t" * 4000)
    assert len(str(error)) < 200 and error.details["field"] == "content_type"


def test_msgpack_of_many_small_containers_is_refused_quickly() -> None:
    """1 MiB of empty maps would become about 72 MiB of dicts."""
    hostile = msgpack.packb([[{}] * 60_000 for _ in range(17)])
    started = time.perf_counter()
    with pytest.raises(ValueError, match="arrays and maps"):
        protocol.decode(hostile, MSGPACK)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("hostile", [
    msgpack.packb([None] * (entry_rules.MAX_CONTAINER_ITEMS + 1)),
    b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G items
    msgpack.packb({"text": msgpack.ExtType(1, b"x" * 100)}),
])
def test_msgpack_container_limits(hostile: bytes) -> None:
    with pytest.raises(ValueError, match="msgpack"):
        protocol.decode(hostile, MSGPACK)


def test_json_of_many_objects_is_refused() -> None:
    with pytest.raises(ValueError, match="too complex"):
        protocol.decode(json.dumps([{}] * (entry_rules.MAX_CONTAINERS + 1)).encode(), JSON)


LIMIT_CONTAINERS = entry_rules.MAX_CONTAINERS
REASON = f"more than {LIMIT_CONTAINERS} arrays and maps"
OVER_LIMIT = [  # one container too many, the outer array included
    [[]] * LIMIT_CONTAINERS,  # siblings
    [[[[]]]] * (LIMIT_CONTAINERS // 3) + [[]],  # nested three deep
    [{}] * 8000 + [[]] * (LIMIT_CONTAINERS - 8000),  # maps and arrays together
]


@pytest.mark.parametrize("payload", OVER_LIMIT, ids=["siblings", "nested", "mixed"])
def test_json_arrays_count_against_the_container_limit_as_msgpacks_do(payload: list) -> None:
    """json has no hook for arrays: '[[],[],...]' once decoded past the limit unchecked."""
    reasons = []
    for data, content_type in ((json.dumps(payload).encode(), JSON),
                               (msgpack.packb(payload), MSGPACK)):
        with pytest.raises(ValueError) as caught:
            protocol.decode(data, content_type)
        reasons.append(str(caught.value).split(": ", 1)[1])
    assert reasons == [REASON, REASON]  # the same reason; either is invalid_request


@pytest.mark.parametrize("payload", [
    [[]] * (LIMIT_CONTAINERS - 1),  # exactly the limit, the outer array included
    [{}] * 8000 + [[]] * (LIMIT_CONTAINERS - 8001),
    {"text": "[" * 200_000, "tags": ["[", "[[", "]"]},  # '[' in strings is no array
    [[]] * (LIMIT_CONTAINERS - 1) + ["[" * LIMIT_CONTAINERS],  # the limit, walked exactly
], ids=["arrays", "mixed", "brackets-in-strings", "limit-and-brackets"])
def test_json_at_the_container_limit_decodes(payload: object) -> None:
    assert protocol.decode(json.dumps(payload).encode(), JSON) == payload
    assert protocol.decode(msgpack.packb(payload), MSGPACK) == payload


def test_a_mebibyte_of_empty_json_arrays_is_refused_quickly() -> None:
    hostile = b"[" + b"[]," * 349_000 + b"[]]"
    gc.collect()
    gc.disable()  # timed: the decode's own cost, not a collection of the session's heap
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="too complex: " + REASON):
            protocol.decode(hostile, JSON)
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    assert elapsed < 1.0


def test_ordinary_payloads_still_decode() -> None:
    payload = {"text": "x" * 100_000, "messages": [{"role": "user", "content": "hi"}] * 50,
               "embedding": b"\x00" * 1536}
    assert protocol.decode(msgpack.packb(payload), MSGPACK) == payload
    assert protocol.decode(json.dumps({"a": [1, 2, {"b": None}]}).encode(), JSON) == \
        {"a": [1, 2, {"b": None}]}


@pytest.mark.parametrize("hostile", [
    b'{"text": "\\ud800"}',  # an escaped high surrogate alone
    b'{"text": "ok \\udc00 ok"}',  # a low one
    b'{"text": ["a", "\\uD83D"]}',  # upper-case hex, in a list
    b'{"text": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8
])
def test_json_strings_with_half_a_surrogate_pair_are_refused(hostile: bytes) -> None:
    """No text holds one, and a tokenizer fails on it: the entry gets invalid_request."""
    with pytest.raises(ValueError, match="unpaired UTF-16 surrogate"):
        protocol.decode(hostile, JSON)


def test_json_with_whole_surrogate_pairs_and_hangul_still_decodes() -> None:
    """Python's json.dumps escapes an emoji as a pair; U+D55C's UTF-8 starts with 0xED."""
    assert protocol.decode(json.dumps({"text": "😀 한"}).encode(), JSON) == {"text": "😀 한"}
    assert protocol.decode(json.dumps({"text": "😀 한"}, ensure_ascii=False).encode(),
                           JSON) == {"text": "😀 한"}
