"""The batch job's pure pieces: ids and keys, input line checks, output lines, objects."""

from __future__ import annotations

import json

import pytest

from producer.batches import keys, lines, objects
from producer.gateway.errors import ApiError


def line(custom_id: str = "a", url: str = "/v1/embeddings", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "minilm", "input": "hi", **body}}).encode()


def test_request_ids_round_trip_and_foreign_ids_are_refused() -> None:
    batch = keys.new_batch_id()
    assert keys.parse_request_id(keys.request_id(batch, 12, 3, 1)) == (12, 3, 1)
    assert keys.parse_request_id("req-1") is None
    assert keys.parse_request_id(f"{batch}-x-1-2") is None


def test_a_batchs_keys_share_one_hash_tag_and_its_output_files_live_there() -> None:
    batch = keys.new_batch_id()
    batch_keys = keys.BatchKeys("redbatch", batch)
    assert {k.split("{")[1].split("}")[0] for k in batch_keys.all()} == {batch}
    meta, content = keys.file_keys("redbatch", keys.output_file_id(batch, "errors"))
    assert (meta, content) == (batch_keys.errors_meta, batch_keys.errors)
    assert keys.is_file_id(keys.new_file_id()) and not keys.is_file_id("file-../x")


def test_owners_are_digests_never_the_key() -> None:
    assert keys.owner_of(None) == "public"
    assert "secret" not in keys.owner_of("secret") and len(keys.owner_of("secret")) == 16
    assert keys.owner_of("a") != keys.owner_of("b")


@pytest.mark.parametrize(("raw", "code"), [
    (b"{not json", "invalid_json"), (b"[1]", "invalid_json"),
    (json.dumps({"custom_id": "", "url": "/v1/embeddings", "body": {}}).encode(), "invalid_line"),
    (json.dumps({"custom_id": "a", "url": "/v1/images", "body": {}}).encode(), "invalid_url"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/embeddings",
                 "body": {}}).encode(), "invalid_line"),
    (b"x" * 101, "line_too_large"),
])
def test_malformed_lines_are_named(raw: bytes, code: str) -> None:
    with pytest.raises(lines.LineProblem) as caught:
        lines.read_line(raw, 100)
    assert caught.value.code == code


def test_the_validator_finds_duplicates_other_urls_models_and_the_line_limit() -> None:
    validator = lines.Validator("/v1/embeddings", max_lines=3, max_line_bytes=10_000)
    for number, raw in enumerate([line("a"), line("a"), line("b", url="/v1/completions"),
                                  line("c", model="other")], start=1):
        validator.feed(number, raw)
    found = [(e["code"], e["line"]) for e in validator.finish()]
    assert found == [("too_many_lines", None), ("duplicate_custom_id", 2),
                     ("mismatched_url", 3), ("mismatched_model", 4)]
    assert lines.Validator("/v1/embeddings", 3, 100).finish()[0]["code"] == "empty_file"


def test_an_embeddings_line_is_one_request_per_input_and_shaped_as_the_route() -> None:
    work = lines.work_of(lines.read_line(line(input=["x", "y"]), 10_000), 16, 0)
    assert work.payloads == [{"text": "x"}, {"text": "y"}]
    envelopes = [{"id": "r", "ok": True, "result": {"embedding": [0.5], "tokens": 2}}] * 2
    ok, out = lines.output_of(lines.read_line(line(), 10_000), work, "rid", envelopes)
    assert ok and out["response"]["status_code"] == 200 and out["error"] is None
    assert out["response"]["body"]["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert out["custom_id"] == "a" and out["response"]["request_id"] == "rid"


def test_a_worker_failure_is_an_error_line_with_the_routes_status() -> None:
    read = lines.read_line(line(), 10_000)
    work = lines.work_of(read, 16, 0)
    ok, out = lines.output_of(read, work, "rid", [{"id": "r", "ok": False, "error": {
        "code": "invalid_request", "message": "too long"}}])
    assert not ok and out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["code"] == "invalid_request"


def test_a_streamed_or_invalid_body_is_refused_before_it_runs() -> None:
    chat = lines.read_line(json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}}), 10_000)
    with pytest.raises(ApiError):
        lines.work_of(chat, 16, 0)
    with pytest.raises(ApiError):
        lines.work_of(lines.read_line(line(input=[]), 10_000), 16, 0)


def test_outcomes_defer_shed_lines_and_expire_late_ones() -> None:
    def failed(code: str) -> dict[str, object]:
        return {"ok": False, "error": {"code": code}}
    assert lines.outcome([failed("overloaded")]) == lines.RETRY
    assert lines.outcome([{"ok": True}, failed("deadline_exceeded")]) == lines.EXPIRE
    assert lines.outcome([failed("duplicate_id")]) == lines.IGNORE
    assert lines.outcome([{"ok": True}]) is None


def test_a_batch_object_has_every_field_typed_as_openai_sends_it() -> None:
    obj = objects.batch_object({b"id": b"batch_x", b"status": b"in_progress",
                                b"created_at": b"10", b"output_file_id": b"", b"total": b"5",
                                b"completed": b"2", b"metadata": b'{"k": "v"}'})
    assert obj["request_counts"] == {"total": 5, "completed": 2, "failed": 0}
    assert obj["output_file_id"] is None and obj["errors"] is None
    assert obj["created_at"] == 10 and obj["completed_at"] is None
    assert obj["metadata"] == {"k": "v"} and obj["object"] == "batch"
    assert objects.file_object({b"id": b"file-1", b"bytes": b"3"})["status"] == "processed"


def test_windows_metadata_and_rate() -> None:
    assert objects.window_seconds("24h") == 86_400 and objects.window_seconds("90s") == 90
    assert objects.window_seconds("25h") is None and objects.window_seconds("1d") is None
    assert objects.metadata_problem({"k": "v"}) is None
    assert objects.metadata_problem({"k": 1}) and objects.metadata_problem(["x"])
    per_s, eta = objects.rate({"in_progress_at": "100", "completed": "10", "total": "30"}, 110)
    assert (per_s, eta) == (1.0, 20.0)
