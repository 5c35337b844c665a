"""Generative models end to end: a real Redis, a real worker, the tiny GPT-2 (tests/rigs/tiny_lm.py)
and SmolLM2-135M-Instruct (slow)."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import torch
from structlog.testing import capture_logs

from producer import protocol
from tests.rigs.tiny_lm import build_tiny_lm, engine_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STREAM = "redbatch:requests:causal_lm"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-e2e"))


@pytest.fixture(scope="module")
def reference_lm(tiny_path: Path) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    yield AutoModelForCausalLM.from_pretrained(tiny_path).eval(), \
        AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(params=[False, True], ids=["steps-in-turn", "overlapped-steps"])
def tiny_worker(worker_factory: Callable[..., Any], tiny_path: Path,
                request: pytest.FixtureRequest) -> Iterator[Any]:
    """The tiny model's worker, its steps one after another (as on a CPU) or overlapped (as
    on a GPU: step n's tokens read while step n + 1 runs, pipeline/generate.py)."""
    options = {"path": str(tiny_path), "max_new_tokens": 16, "max_new_tokens_limit": 64,
               "overlap_steps": request.param}
    with worker_factory(model="causal_lm", model_options=options) as worker:
        assert worker.computes[0].overlap is request.param
        yield worker


def send(r: redis.Redis, payload: dict[str, Any], request_id: str | None = None,
         msgpack_payload: bool = False, stream: str = STREAM, **fields: Any) -> str:
    request_id = request_id or uuid.uuid4().hex
    if msgpack_payload:
        r.xadd(stream, {"id": request_id, "payload": msgpack.packb(payload), **fields})
    else:
        r.xadd(stream, {"id": request_id, "content_type": protocol.JSON,
                        "payload": json.dumps(payload), **fields})
    return request_id


def read_stream(r: redis.Redis, key: str, timeout_s: float = 30) -> list[tuple[str, Any]]:
    """XREAD from 0-0 until the `done` entry: (entry id, envelope) in order."""
    entries, last, deadline = [], "0-0", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, batch in r.xread({key: last}, count=100, block=500) or []:
            for entry_id, fields in batch:
                last = entry_id.decode()
                data = fields[b"data"]
                envelope = json.loads(data) if data[:1] == b"{" else msgpack.unpackb(data)
                entries.append((last, envelope))
                if envelope["type"] == "done":
                    return entries
    raise TimeoutError(f"no done entry on {key}: {entries}")


def stream_key(request_id: str) -> str:
    return f"redbatch:stream:{request_id}"


def list_reply(r: redis.Redis, request_id: str) -> dict[str, Any]:
    popped = r.blpop([protocol.reply_key("redbatch", request_id)], timeout=30)
    assert popped is not None, "no reply"
    return protocol.decode_envelope(popped[1])


def generated_text(lm: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, pad_token_id=0)
    return str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def test_a_streamed_answer_equals_the_unstreamed_one_and_generate(
        tiny_worker: Any, r: redis.Redis, reference_lm: tuple[Any, Any]) -> None:
    prompt = "hello redis, hello"
    streamed_id = send(r, {"prompt": prompt, "max_new_tokens": 24})
    plain_id = send(r, {"prompt": prompt, "max_new_tokens": 24, "stream": False})
    entries = read_stream(r, stream_key(streamed_id))
    deltas, done = [e for _, e in entries[:-1]], entries[-1][1]
    assert [i for i, _ in entries] == [f"{n}-1" for n in range(1, len(entries) + 1)]
    assert [d["index"] for d in deltas] == list(range(1, len(deltas) + 1))
    assert all(d["type"] == "delta" and d["id"] == streamed_id for d in deltas)
    assert done["ok"] and done["result"]["finish_reason"] in ("stop", "length")
    text = "".join(d["text"] for d in deltas)
    assert text == done["result"]["text"]
    assert set(done["meta"]) >= {"model", "queue_ms", "ttft_ms", "compute_ms", "worker"}
    plain = list_reply(r, plain_id)
    assert plain["ok"] and "type" not in plain and plain["result"]["text"] == text
    assert text == generated_text(*reference_lm, prompt, 24)
    assert 0 < r.pttl(stream_key(streamed_id)) <= 3_600_000
    assert r.xpending(STREAM, "workers")["pending"] == 0  # acked with the done entry


def test_msgpack_requests_stream_msgpack_and_reply_to_names_the_stream(
        tiny_worker: Any, r: redis.Redis) -> None:
    request_id = send(r, {"messages": [{"role": "user", "content": "hello"}]},
                      msgpack_payload=True, reply_to="redbatch:stream:mine")
    entries = read_stream(r, "redbatch:stream:mine")
    assert entries[-1][1]["ok"] and entries[-1][1]["result"]["tokens"] >= 1
    assert entries[-1][1]["id"] == request_id
    raw = r.xrange("redbatch:stream:mine")[0][1][b"data"]
    assert raw[:1] != b"{"  # msgpack, as the request


def test_cancel_ends_the_generation_with_finish_reason_cancelled(
        tiny_worker: Any, r: redis.Redis) -> None:
    request_id = uuid.uuid4().hex
    r.set(protocol.cancel_key("redbatch", request_id), 1, px=60_000)
    send(r, {"prompt": "the quick brown fox", "max_new_tokens": 60}, request_id)
    done = read_stream(r, stream_key(request_id))[-1][1]
    assert done["ok"] and done["result"]["finish_reason"] == "cancelled"
    assert done["result"]["tokens"] < 60


BAD_INPUTS = [  # (payload, words of the message, the error's field or reason)
    ({"prompt": 42}, "'prompt' must be a string", ("field", "prompt")),
    ({"messages": [{"role": "user"}]}, "messages[0]", ("field", "messages")),
    ({"messages": "hi"}, "payload must be an object", None),
    ({"text": "hi"}, "payload must be an object", None),
    ({"prompt": "hi", "max_new_tokens": 0}, "between 1 and 64", ("field", "max_new_tokens")),
    ({"prompt": "hi", "max_new_tokens": 65}, "max_new_tokens_limit",
     ("field", "max_new_tokens")),
    ({"prompt": "hi", "temperature": -1}, "'temperature' must be >= 0", ("field", "temperature")),
    ({"prompt": "hi", "top_p": 0}, "'top_p'", ("field", "top_p")),
    ({"prompt": "hi", "top_k": -1}, "'top_k'", ("field", "top_k")),
    ({"prompt": "hi", "seed": "x"}, "'seed' must be an integer", ("field", "seed")),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "at most 4", ("field", "stop")),
    ({"prompt": "hi", "stop": ["a", "b" * 1001]}, "1001 characters; at most 1000",
     ("field", "stop")),
    ({"prompt": "the quick brown fox " * 40}, "the context window of this model is 128",
     ("reason", "context_window")),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "not both",
     ("field", "messages")),
    ({"prompt": "hi", "stream": 1}, "'stream' must be true or false", ("field", "stream")),
]


def test_bad_input_is_answered_invalid_request_and_the_worker_keeps_serving(
        tiny_worker: Any, r: redis.Redis) -> None:
    ids = [send(r, payload) for payload, _, _ in BAD_INPUTS]
    for request_id, (_, message, detail) in zip(ids, BAD_INPUTS, strict=True):
        entries = read_stream(r, stream_key(request_id))
        assert len(entries) == 1 and entries[0][0] == "1-1"
        done = entries[0][1]
        assert done["type"] == "done" and not done["ok"], done
        assert done["error"]["code"] == "invalid_request" and message in done["error"]["message"]
        if detail:
            assert done["error"][detail[0]] == detail[1], done
        else:
            assert "field" not in done["error"] and "reason" not in done["error"]
    plain = send(r, {"prompt": 7, "stream": False})
    assert list_reply(r, plain)["error"]["code"] == "invalid_request"
    for payload in ("{nope", '{"prompt": "half a pair: \\ud800"}'):  # the tokenizer fails
        undecodable = uuid.uuid4().hex
        r.xadd(STREAM, {"id": undecodable, "content_type": protocol.JSON, "payload": payload})
        [(_, done)] = read_stream(r, stream_key(undecodable))
        assert done["error"]["code"] == "invalid_request", done
    good = send(r, {"prompt": "hello", "max_new_tokens": 3})
    assert read_stream(r, stream_key(good))[-1][1]["ok"]
    # past any vocabulary, as 0: every token (not an overflow of the sampler's int64 inputs)
    wide = send(r, {"prompt": "hello", "max_new_tokens": 3, "temperature": 1.0, "seed": 1,
                    "top_k": 10 ** 20})
    assert read_stream(r, stream_key(wide))[-1][1]["ok"]


# A Mistral / Llama-2 style template: its raise_exception refuses roles that do not alternate.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_messages_a_chat_template_refuses_are_invalid_request_without_a_traceback(
        worker_factory: Callable[..., Any], tiny_path: Path, r: redis.Redis,
        tmp_path: Path) -> None:
    """A template's raise_exception is jinja2's TemplateError, not a ValueError: it must
    still be the request's fault (invalid_request, the template's message), not the model's
    (model_error, its traceback logged with the user's messages)."""
    path = Path(shutil.copytree(tiny_path, tmp_path / "alternating"))
    (path / "chat_template.jinja").write_text(ALTERNATING_TEMPLATE)
    options = {"path": str(path), "max_new_tokens": 3}
    with capture_logs() as logs, worker_factory(model="causal_lm", model_options=options):
        twice = [{"role": "user", "content": "secret one"},
                 {"role": "user", "content": "secret two"}]
        bad = send(r, {"messages": twice, "stream": False})
        good = send(r, {"messages": [{"role": "user", "content": "hello"}], "stream": False})
        refused, served = list_reply(r, bad), list_reply(r, good)
    assert refused["error"]["code"] == "invalid_request", refused
    assert "Conversation roles must alternate" in refused["error"]["message"]
    assert refused["error"]["field"] == "messages"
    assert served["ok"] and served["result"]["tokens"] == 3, served
    assert not [entry for entry in logs
                if "exc_info" in entry or entry["log_level"] in ("error", "critical")]


FORGERIES = {  # deltas a producer wrote to its request's reply stream: (token ids, message)
    "outside-the-vocabulary": ([[10 ** 6]], "holds tokens the model lacks"),
    # a resume of millions of tokens would hold up the worker's every request: none is read
    # past max_new_tokens, as no worker writes more
    "more-than-max-new-tokens": ([[5] * 3] * 20, "holds over 8 tokens"),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_resume_from_a_forged_reply_stream_is_answered_and_reaches_no_model(
        worker_factory: Callable[..., Any], tiny_path: Path, r: redis.Redis,
        forgery: str) -> None:
    """A producer can write a request's reply stream before a worker takes the request over:
    tokens outside the vocabulary (an index error on a CPU, a device assert that ends the
    process on CUDA), or more than the request may generate, never reach the model; the
    request gets an error after those entries."""
    deltas, message = FORGERIES[forgery]
    r.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    forged = send(r, {"prompt": "hi", "max_new_tokens": 8})
    r.xreadgroup("workers", "gone", {STREAM: ">"})  # read by a worker that then died
    for index, token_ids in enumerate(deltas, 1):
        delta = {"id": forged, "type": "delta", "index": index, "text": "x",
                 "token_ids": token_ids}
        r.xadd(stream_key(forged), {"data": json.dumps(delta)}, id=f"{index}-1")
    options = {"path": str(tiny_path), "max_new_tokens": 8, "max_new_tokens_limit": 64}
    with worker_factory(model="causal_lm", model_options=options, claim_idle_ms=200):
        entries = read_stream(r, stream_key(forged))
        assert [e[0] for e in entries] == [f"{n}-1" for n in range(1, len(deltas) + 2)]
        error = entries[-1][1]["error"]
        assert error["code"] == "invalid_request" and message in error["message"], entries
        good = send(r, {"prompt": "hello", "max_new_tokens": 3})
        assert read_stream(r, stream_key(good))[-1][1]["ok"]
    assert r.xpending(STREAM, "workers")["pending"] == 0



@pytest.mark.parametrize("overlap", [False, True], ids=["steps-in-turn", "overlapped-steps"])
def test_steps_that_run_out_of_memory_are_recomputed_smaller_and_nothing_is_lost(
        worker_factory: Callable[..., Any], tiny_path: Path, r: redis.Redis,
        reference_lm: tuple[Any, Any], overlap: bool) -> None:
    """A device that runs out of memory in any forward of more than 24 tokens or 2 rows: a
    long prompt's prefill fails (the step's token cap is cut to half of it), four sequences
    decoding together fail (the sequence cap is cut to 2, the newest wait again); their
    sequences are recomputed, and every answer is the uninterrupted one (greedy, seeded)."""
    from worker.models.generation_params import SamplingParams

    prompts = ["the quick brown fox jumps over the lazy dog " * k for k in (1, 2, 3)]
    options = {"path": str(tiny_path), "max_new_tokens": 12, "max_new_tokens_limit": 64,
               "max_tokens": 24, "max_rows": 2, "overlap_steps": overlap}
    with worker_factory(model="tests.rigs.plugin_models:ShortOfMemoryLM",
                        model_name="causal_lm", model_options=options) as worker:
        greedy = [send(r, {"prompt": p, "max_new_tokens": 12}) for p in prompts]
        seeded = send(r, {"prompt": prompts[2], "max_new_tokens": 12, "temperature": 0.9,
                          "seed": 7})
        texts = [read_stream(r, stream_key(i))[-1][1] for i in [*greedy, seeded]]
        caps = worker.computes[0].scheduler.caps
        assert caps.tokens == 16 and caps.seqs <= 2  # the rows that failed, halved
        assert worker.model.out_of_memory >= 2  # a prefill and a decoding step at least
    assert all(t["ok"] for t in texts), texts
    for text, prompt in zip(texts, prompts, strict=False):
        assert text["result"]["text"] == generated_text(*reference_lm, prompt, 12)
    assert texts[3]["result"]["text"] == engine_text(
        *reference_lm, prompts[2], SamplingParams(12, temperature=0.9, seed=7))


def test_a_sequence_that_runs_out_of_memory_alone_is_answered_too_large(
        worker_factory: Callable[..., Any], tiny_path: Path, r: redis.Redis,
        reference_lm: tuple[Any, Any]) -> None:
    """A device that cannot run 9 tokens: a prompt of 40 runs out at every step size down to
    16-token chunks of one sequence, and is answered; a short one decoding meanwhile, whose
    rows came after that chunk in a step that ran out, is recomputed and served whole."""
    options = {"path": str(tiny_path), "max_new_tokens": 4, "max_new_tokens_limit": 64,
               "max_tokens": 8}
    with worker_factory(model="tests.rigs.plugin_models:ShortOfMemoryLM",
                        model_name="causal_lm", model_options=options) as worker:
        short = send(r, {"prompt": "hello", "max_new_tokens": 60})
        deadline = time.monotonic() + 30
        while not r.exists(stream_key(short)) and time.monotonic() < deadline:
            time.sleep(0.001)  # decoding now: the long one's steps carry its rows
        long = send(r, {"prompt": "the quick brown fox jumps over the lazy dog"})
        [(_, done)] = read_stream(r, stream_key(long))
        assert done["error"]["code"] == "too_large", done
        assert "smallest step" in done["error"]["message"]
        answer = read_stream(r, stream_key(short))[-1][1]
        assert answer["result"]["text"] == generated_text(*reference_lm, "hello", 60)
        assert worker.model.out_of_memory >= 2

@pytest.mark.parametrize("fields, message", [
    ({"deadline_ms": "soon"}, "'deadline_ms' must be an integer"),
    ({"priority": "high"}, "'priority' must be an integer"),
    ({"content_type": "text/plain"}, "unknown content_type"),
])
def test_a_bad_entry_field_is_answered_on_the_reply_stream(
        tiny_worker: Any, r: redis.Redis, fields: dict[str, str], message: str) -> None:
    """The reader of a streamed request waits on its stream, not on the list key (and one
    that asked for no stream, in a payload that can be read, on the list key)."""
    request_id = uuid.uuid4().hex
    r.xadd(STREAM, {"id": request_id, "content_type": protocol.JSON,
                    "payload": json.dumps({"prompt": "hi"}), **fields})
    [(entry_id, done)] = read_stream(r, stream_key(request_id))
    assert entry_id == "1-1" and done["error"]["code"] == "invalid_request"
    assert message in done["error"]["message"]
    if "content_type" in fields:
        return  # an unknown content type: the payload cannot be read, so it streams
    plain = uuid.uuid4().hex
    r.xadd(STREAM, {"id": plain, "content_type": protocol.JSON,
                    "payload": json.dumps({"prompt": "hi", "stream": False}), **fields})
    assert message in list_reply(r, plain)["error"]["message"]


def test_null_means_the_default_and_a_tiny_temperature_samples(
        tiny_worker: Any, r: redis.Redis) -> None:
    """A temperature of 1e-300 is a valid number: it must sample (all but greedily) and
    not overflow, which would fail every generation sharing its step."""
    beside = send(r, {"prompt": "the quick brown fox", "max_new_tokens": 8})
    tiny = send(r, {"prompt": "hi", "temperature": 1e-300, "max_new_tokens": 3, "seed": 1})
    nulls = send(r, {"prompt": "hi", "max_new_tokens": None, "temperature": None,
                     "top_p": None, "top_k": None, "seed": None, "stop": None,
                     "stream": None})
    assert read_stream(r, stream_key(beside))[-1][1]["result"]["tokens"] == 8
    assert read_stream(r, stream_key(tiny))[-1][1]["result"]["tokens"] <= 3
    done = read_stream(r, stream_key(nulls))[-1][1]
    assert done["ok"] and done["result"]["tokens"] <= 16, done  # max_new_tokens 16


def test_concurrent_requests_share_decoding_steps(tiny_worker: Any, r: redis.Redis,
                                                  reference_lm: tuple[Any, Any]) -> None:
    prompts = ["hello world", "redis streams carry", "the lazy dog", "what is the capital",
               "continuous batching lets", "hello batching"]
    steps_before = tiny_worker.computes[0].steps
    pipe = r.pipeline()
    ids = [uuid.uuid4().hex for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        pipe.xadd(STREAM, {"id": request_id, "content_type": protocol.JSON,
                           "payload": json.dumps({"prompt": prompt, "max_new_tokens": 30,
                                                  "stream": False})})
    pipe.execute()
    results = [list_reply(r, i)["result"] for i in ids]
    steps = tiny_worker.computes[0].steps - steps_before
    tokens = sum(res["tokens"] for res in results)
    assert steps < tokens * 0.6, f"{steps} steps for {tokens} tokens: not batched"
    for prompt, res in zip(prompts, results, strict=True):
        assert res["text"] == generated_text(*reference_lm, prompt, 30)


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(worker_factory: Callable[..., Any],
                                               r: redis.Redis) -> None:
    with worker_factory(model="smollm2"):
        request_id = send(r, {"messages": [{"role": "user",
                                            "content": "What is the capital of France?"}],
                              "max_new_tokens": 24}, stream="redbatch:requests:smollm2")
        done = read_stream(r, stream_key(request_id), timeout_s=60)[-1][1]
    assert done["ok"], done
    assert "Paris" in done["result"]["text"]


def test_a_generation_past_its_deadline_is_stopped_after_its_chunks(
        tiny_worker: Any, r: redis.Redis) -> None:
    """A deadline that passes mid-generation ends it with `deadline_exceeded` as the done
    entry right after the chunks already streamed; the worker keeps serving."""
    prompt, stopped = "the quick brown fox jumps", []
    for delay_ms in (5, 10, 20, 40, 80, 160, 320):
        deadline_ms = int(time.time() * 1000) + delay_ms
        request_id = send(r, {"prompt": prompt, "max_new_tokens": 64},
                          deadline_ms=deadline_ms)
        entries = read_stream(r, stream_key(request_id))
        done = entries[-1][1]
        assert [i for i, _ in entries] == [f"{n}-1" for n in range(1, len(entries) + 1)]
        if not done["ok"]:
            assert done["error"]["code"] == "deadline_exceeded"
            if len(entries) > 1:
                stopped.append(done["error"]["message"])
    assert stopped and all("while generating" in m for m in stopped)
    after = read_stream(r, stream_key(send(r, {"prompt": prompt, "max_new_tokens": 4})))
    assert after[-1][1]["ok"]
    assert r.xpending(STREAM, "workers")["pending"] == 0
