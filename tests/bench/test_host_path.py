"""The host path of an embedding model (issue 31): a read's payloads tokenised in one call,
one array op per collate, numpy rows out, and the float32 reply encoding."""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import torch

from producer import Client, protocol
from producer.embeddings import as_float32_bytes, decode_reply, decode_result
from producer.request_entry import entry_fields
from tests.rigs.workers import loaded_model
from worker.models.base import InvalidInput, Model, Prepared
from worker.models.minilm import MiniLMModel
from worker.pipeline import worker as worker_module
from worker.pipeline.encoding import encode_envelope

TEXTS = ["A cat sat on the mat.", "x", "Redis Streams feed a worker that batches requests.",
         "Ünïcödé and emoji 🙂 " * 60]


@pytest.fixture(scope="module")
def minilm() -> MiniLMModel:
    model = loaded_model("minilm")
    assert isinstance(model, MiniLMModel)
    return model


def test_prepare_many_tokenises_as_prepare_does_and_refuses_in_place(minilm: MiniLMModel) -> None:
    payloads = [{"text": TEXTS[0]}, {"txt": "no"}, {"text": TEXTS[3], "encoding": "float32"},
                {"text": "y", "encoding": "f16"}, {"text": TEXTS[1]}]
    many = minilm.prepare_many([(p, 10) for p in payloads])
    assert [type(m).__name__ for m in many] == ["Prepared", "InvalidInput", "Prepared",
                                                "InvalidInput", "Prepared"]
    for payload, item in zip(payloads, many, strict=True):
        if isinstance(item, Prepared):
            one = minilm.prepare(payload, 10)
            assert (item.length, item.data.ids, item.data.binary) == (
                one.length, one.data.ids, one.data.binary)
    assert many[2].length == 256 and many[2].data.binary  # type: ignore[union-attr]
    assert isinstance(many[3], InvalidInput) and many[3].details == {"field": "encoding"}


class Picky(Model):
    """prepare refuses odd numbers and fails on 13."""

    def load(self, device: torch.device) -> None:
        pass

    def prepare(self, payload: Any, nbytes: int) -> Prepared:
        if payload == 13:
            raise RuntimeError("unlucky")
        if payload % 2:
            raise InvalidInput("odd")
        return Prepared(1, payload)

    def collate(self, items: Sequence[Prepared]) -> Any:
        return [item.data for item in items]

    def forward(self, batch: Any) -> Any:
        return batch

    def postprocess(self, output: Any, items: Sequence[Prepared]) -> list[Any]:
        return list(output)


def test_the_default_prepare_many_answers_each_payload_alone() -> None:
    got = Picky().prepare_many([(2, 1), (3, 1), (13, 1), (4, 1)])
    assert [g.data if isinstance(g, Prepared) else type(g).__name__ for g in got] == [
        2, "InvalidInput", "RuntimeError", 4]


def row_by_row(items: Sequence[Prepared]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(item.length for item in items)
    ids = torch.zeros((len(items), longest), dtype=torch.long)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :item.length] = torch.tensor(item.data.ids)
        mask[row, :item.length] = 1
    return ids, mask


def test_collate_pads_as_row_by_row_did(minilm: MiniLMModel) -> None:
    items = [i for i in minilm.prepare_many([({"text": t}, 1) for t in TEXTS])
             if isinstance(i, Prepared)]
    batch = minilm.collate(items)
    ids, mask = row_by_row(items)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["attention_mask"], mask)
    assert batch["input_ids"].dtype == torch.long


def test_postprocess_gives_numpy_rows_or_float32_bytes(minilm: MiniLMModel) -> None:
    items = [minilm.prepare({"text": "a"}, 1),
             minilm.prepare({"text": "b", "encoding": "float32"}, 1)]
    output = torch.arange(2 * 384, dtype=torch.float32).view(2, 384) / 1000
    plain, binary = minilm.postprocess(output, items)
    assert isinstance(plain["embedding"], np.ndarray) and plain["tokens"] == 3
    assert np.array_equal(plain["embedding"], output[0].numpy())
    assert binary["embedding"] == output[1].numpy().astype("<f4").tobytes()


def envelope(embedding: Any) -> dict[str, Any]:
    return {"id": "r1", "ok": True, "result": {"embedding": embedding, "tokens": 5},
            "meta": {"model": "minilm", "batch_size": 2, "queue_ms": 1.5, "worker": "w"}}


@pytest.mark.parametrize("size", [3, 16, 384, 70_000])
def test_numpy_rows_encode_byte_for_byte_as_float_lists(size: int) -> None:
    row = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    for content_type in protocol.CONTENT_TYPES:
        assert encode_envelope(envelope(row), content_type) == protocol.encode(
            envelope(row.tolist()), content_type)


def test_scratch_rows_are_reused_per_size_and_thread_byte_for_byte() -> None:
    """Sizes interleaved (more than a thread keeps), and threads encoding at once."""
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(size).astype(np.float32)
            for size in (384, 3, 384, *range(1, 12), 384, 0)]

    def check(_: int) -> bool:
        return all(encode_envelope(envelope(row), protocol.MSGPACK)
                   == protocol.encode(envelope(row.tolist()), protocol.MSGPACK) for row in rows)

    assert check(0)
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(16)))


def test_several_rows_and_envelopes_without_rows_encode_as_before() -> None:
    rows = np.ones((2, 4), np.float32)
    nested = {"id": "r", "ok": True, "result": [{"embedding": rows[0]}, {"e": rows[1]}],
              "meta": {}}
    listed = {"id": "r", "ok": True, "result": [{"embedding": [1.0] * 4}, {"e": [1.0] * 4}],
              "meta": {}}
    assert encode_envelope(nested, protocol.MSGPACK) == protocol.encode(listed, protocol.MSGPACK)
    plain = envelope({"text": "echoed"})
    assert encode_envelope(plain, protocol.MSGPACK) == protocol.encode(plain, protocol.MSGPACK)


def test_float32_bytes_are_msgpack_bin_and_base64_in_json() -> None:
    vector = np.array([0.5, -1.25, 3.0], np.float32)
    data = as_float32_bytes(vector)
    assert data == b"\x00\x00\x00?\x00\x00\xa0\xbf\x00\x00@@"  # little-endian float32
    packed = msgpack.unpackb(encode_envelope(envelope(data), protocol.MSGPACK), raw=False)
    assert packed["result"]["embedding"] == data  # bin, not str
    text = json.loads(encode_envelope(envelope(data), protocol.JSON))
    assert text["result"]["embedding"] == base64.b64encode(data).decode()
    for content_type in protocol.CONTENT_TYPES:
        reply = encode_envelope(envelope(data), content_type)
        assert decode_reply(reply)["result"]["embedding"] == [0.5, -1.25, 3.0]
        as_array = decode_reply(reply, as_numpy=True)["result"]["embedding"]
        assert as_array.dtype == np.float32 and as_array.tolist() == [0.5, -1.25, 3.0]


def test_results_that_are_not_encoded_vectors_pass_through() -> None:
    assert decode_result({"embedding": "not base64!"}) == {"embedding": "not base64!"}
    assert decode_result({"text": "x"}, as_numpy=True) == {"text": "x"}
    listed = decode_result({"embedding": [1.0, 2.0]}, as_numpy=True)["embedding"]
    assert isinstance(listed, np.ndarray) and listed.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("content_type", protocol.CONTENT_TYPES)
def test_float32_replies_match_the_float_lists_end_to_end(
        redis_url: str, worker_factory: Callable[..., Any], content_type: str) -> None:
    client = Client(redis_url, "minilm", content_type=content_type)
    with worker_factory(model="minilm", max_wait_ms=20):
        listed = [client.submit({"text": t}) for t in TEXTS]
        binary = [client.submit({"text": t, "encoding": "float32"}) for t in TEXTS]
        plain = [client.result(i, timeout=60) for i in listed]
        raw = [client.wait(i, timeout=60, as_numpy=True) for i in binary]
        arrays = [client.infer({"text": TEXTS[0], "encoding": "float32"}, timeout=60,
                               as_numpy=True)]
    client.close()
    for want, got in zip(plain, raw, strict=True):
        vector = got["result"]["embedding"]
        assert isinstance(vector, np.ndarray) and vector.dtype == np.float32
        assert np.allclose(vector, want["embedding"], atol=1e-5)  # batches differ in padding
        assert got["result"]["tokens"] == want["tokens"]
    # another batch, other padding: equal to float32 rounding
    assert np.allclose(arrays[0]["embedding"], plain[0]["embedding"], atol=1e-5)


@pytest.mark.parametrize("threaded", [True, False], ids=["prepare-thread", "reader-thread"])
def test_a_bad_entry_in_a_read_is_refused_alone(
        redis_url: str, worker_factory: Callable[..., Any], minilm: MiniLMModel,
        monkeypatch: pytest.MonkeyPatch, threaded: bool) -> None:
    """One XREADGROUP of seven entries: a text, a payload that is not msgpack, a payload that
    is not a text, a malformed entry (its deadline is not a number), a bad encoding, a long
    text (truncated), a text. One prepare_many call, on the prepare stage's
    thread; each bad one answered alone, the others in their batch."""
    chunks: list[tuple[int, str]] = []
    batch_call = minilm.prepare_many

    def spy(payloads: Sequence[tuple[Any, int]]) -> list[Prepared | Exception]:
        chunks.append((len(payloads), threading.current_thread().name))
        return batch_call(payloads)

    monkeypatch.setattr(minilm, "prepare_many", spy)
    # the prepare thread runs on an accelerator; here it is asked for, or not
    monkeypatch.setattr(worker_module, "prepares_on_a_thread", lambda runners: threaded)
    stream = protocol.stream_key(protocol.DEFAULT_NAMESPACE, "minilm")
    entries = [entry_fields("e0", protocol.encode({"text": "first"}, protocol.MSGPACK)),
               entry_fields("e1", b"\xc1"),
               entry_fields("e2", protocol.encode({"txt": "no"}, protocol.MSGPACK)),
               {**entry_fields("e3", protocol.encode({"text": "y"}, protocol.MSGPACK)),
                "deadline_ms": "soon"},
               entry_fields("e4", protocol.encode({"text": "x", "encoding": 5}, protocol.MSGPACK)),
               entry_fields("e5", protocol.encode({"text": "middle " * 400}, protocol.MSGPACK)),
               entry_fields("e6", protocol.encode({"text": "last one"}, protocol.MSGPACK))]
    r = redis.Redis.from_url(redis_url)
    for fields in entries:  # queued before the worker reads: one read
        r.xadd(stream, fields)  # type: ignore[arg-type]
    client = Client(redis_url, "minilm")
    with worker_factory(model="minilm", instance=minilm):
        replies = [client.wait(f"e{n}", timeout=60) for n in range(len(entries))]
    client.close()
    r.close()
    thread = "redbatch-prepare_0" if threaded else "redbatch-reader"
    assert chunks == [(5, thread)]  # not the undecodable nor the malformed
    assert [e["ok"] for e in replies] == [True, False, False, False, False, True, True]
    assert [e["error"]["code"] for e in replies[1:5]] == ["invalid_request"] * 4
    assert "msgpack" in replies[1]["error"]["message"]
    assert "deadline_ms" in replies[3]["error"]["message"]
    assert replies[4]["error"]["field"] == "encoding"
    assert replies[0]["result"]["tokens"] == 3 and replies[6]["result"]["tokens"] == 4
    assert replies[5]["result"]["tokens"] == 256  # truncated, in the same chunk


def test_the_host_path_benchmark_runs() -> None:
    """In a process of its own: the benchmark configures logging for the whole process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.throughput.host_path", "--requests", "150",
                           "--rounds", "1", "--encoding", "float32"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "instant / echo =" in printed and "tokenise" in printed and "process" in printed


def test_gpu_batching_gives_every_variant_a_cuda_workers_defaults() -> None:
    from bench.throughput.host_path import Layout
    from worker.models.echo import EchoModel

    minilm = MiniLMModel.__new__(MiniLMModel)  # the class's buckets; nothing to load
    assert Layout(2).settings(minilm) == {"instances": 2, "max_batch_size": 64}
    gpu = Layout(1, gpu_batching=True)
    on_cuda = gpu.settings(minilm)
    assert on_cuda["max_batch_size"] == 512 and on_cuda["max_batch_tokens"] == 65_536
    assert on_cuda["bucket_boundaries"] == [8, 12, 20, 32, 48, 80, 128, 192, 256]
    assert gpu.settings(EchoModel())["bucket_boundaries"][-1] == 4096
