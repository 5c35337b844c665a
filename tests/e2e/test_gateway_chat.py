"""/v1/chat/completions and /v1/completions end to end: the gateway (uvicorn in a thread), a
real worker serving the tiny GPT-2 (tests/rigs/tiny_lm.py), a real Redis, the official `openai`
client; raw HTTP cases through httpx."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from producer import protocol
from tests.e2e.test_gateway import assert_openai_error, gateway_factory, sdk  # noqa: F401
from tests.redis.single.test_generation_e2e import read_stream
from tests.rigs.tiny_lm import build_tiny_lm

MODEL = "causal_lm"
MESSAGES = [{"role": "user", "content": "what is the capital of france?"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A long context window, so a generation can run long enough to be cancelled."""
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-gateway"), n_positions=1024)


@pytest.fixture
def served(worker_factory: Callable[..., Any], gateway_factory: Any,  # noqa: F811
           tiny_path: Path) -> Iterator[str]:
    """The gateway's base URL, with a worker serving the tiny model."""
    options = {"path": str(tiny_path), "max_new_tokens": 16, "max_new_tokens_limit": 1000}
    with worker_factory(model=MODEL, model_options=options), gateway_factory() as base_url:
        yield base_url


def post(base_url: str, route: str, body: Any) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{route}", json=body, timeout=30)


def test_streamed_chat_equals_the_unstreamed_answer(served: str) -> None:
    client = sdk(served)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                           user="someone")
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert plain.object == "chat.completion" and plain.model == MODEL
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    assert 0 < plain.usage.completion_tokens <= 24
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in with_choices][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_completions_streamed_and_not(served: str) -> None:
    client = sdk(served)
    plain = client.completions.create(model=MODEL, prompt="hello redis, hello", max_tokens=12)
    chunks = list(client.completions.create(model=MODEL, prompt="hello redis, hello",
                                            max_tokens=12, stream=True))
    assert plain.object == "text_completion" and plain.choices[0].text
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    assert 0 < plain.usage.completion_tokens <= 12
    if plain.choices[0].finish_reason == "length":
        assert plain.usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_seeded_sampling_is_reproducible(served: str) -> None:
    client = sdk(served)
    answers = {client.completions.create(model=MODEL, prompt="the quick", max_tokens=10,
                                         temperature=1.5, top_p=0.95, seed=7).choices[0].text
               for _ in range(2)}
    assert len(answers) == 1


def test_n_past_max_choices_is_400(served: str) -> None:
    with pytest.raises(openai.BadRequestError):
        sdk(served).chat.completions.create(model=MODEL, messages=MESSAGES, n=10_000)
    error = assert_openai_error(post(served, "chat/completions", {
        "model": MODEL, "messages": MESSAGES, "n": 17}), 400, "invalid_request")
    assert error["param"] == "n" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("route, body, param", [
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "functions": []}, "functions"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "stop": ["a"] * 5}, "stop"),
    ("chat/completions", {"model": MODEL, "messages": MESSAGES, "temperature": 9},
     "temperature"),
    ("completions", {"model": MODEL, "prompt": [1, 2, 3]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, "max_tokens"),
], ids=["unknown-field", "bad-messages", "five-stops", "hot", "token-ids", "logprobs",
        "worker-refuses-max-tokens"])
def test_bad_fields_are_400(served: str, route: str, body: dict[str, Any],
                            param: str) -> None:
    error = assert_openai_error(post(served, route, body), 400)
    assert error["param"] == param
    streamed = assert_openai_error(post(served, route, {**body, "stream": True}), 400)
    assert streamed["param"] == param


def test_a_prompt_longer_than_the_context_window_is_context_length_exceeded(
        served: str) -> None:
    """As OpenAI answers it, known from the worker's `reason`, not its wording."""
    body = {"model": MODEL, "prompt": "the quick brown fox " * 400}
    error = assert_openai_error(post(served, "completions", body), 400,
                                "context_length_exceeded")
    assert error["param"] == "prompt" and "context window" in error["message"]


def test_embeddings_on_a_generative_model_are_400_at_once(served: str) -> None:
    response = httpx.post(f"{served}/v1/embeddings", json={"model": MODEL, "input": "hi"},
                          timeout=30)
    error = assert_openai_error(response, 400, "wrong_model_kind")
    assert "is a generative model: use /v1/chat/completions" in error["message"]


def test_unknown_model_is_404(served: str) -> None:
    assert_openai_error(post(served, "completions", {"model": "nope", "prompt": "x"}), 404,
                        "model_not_found")


def test_models_lists_the_generative_model(served: str) -> None:
    assert [m.id for m in sdk(served).models.list().data] == [MODEL]


def test_a_disconnect_mid_stream_cancels_the_generation(served: str,
                                                        r: redis.Redis) -> None:
    stream = sdk(served).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_tokens=900, stream=True)
    first = next(iter(stream))
    request_id = first.id.removeprefix("chatcmpl-")
    stream.close()  # closes the HTTP connection: the gateway sees the client go away
    done = read_stream(r, protocol.token_stream_key("redbatch", request_id))[-1][1]
    assert done["ok"] and done["result"]["finish_reason"] == "cancelled", done["result"]
    assert done["result"]["tokens"] < 900
    assert r.get(protocol.cancel_key("redbatch", request_id)) == b"1"
    assert 0 < r.pttl(protocol.cancel_key("redbatch", request_id)) <= 90_000 + 1_000


def test_a_disconnect_while_waiting_cancels_the_generation(served: str,
                                                           r: redis.Redis) -> None:
    """stream false: the client drops the connection (httpx closes it on its read timeout)
    mid-generation; the gateway sets the cancel key and the worker ends the generation."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served}/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 900},
            timeout=httpx.Timeout(30, read=0.3))
    deadline = time.monotonic() + 10
    while not (keys := r.keys(protocol.cancel_key("redbatch", "*"))):
        assert time.monotonic() < deadline, "the gateway set no cancel key"
        time.sleep(0.02)
    assert len(keys) == 1 and r.get(keys[0]) == b"1"
    request_id = keys[0].decode().rpartition(":")[2]
    popped: Any = r.blpop([protocol.reply_key("redbatch", request_id)], timeout=20)
    assert popped is not None, "the worker sent no reply"
    envelope = protocol.decode_envelope(popped[1])
    assert envelope["ok"] and envelope["result"]["finish_reason"] == "cancelled", envelope
    assert envelope["result"]["tokens"] < 900
    metrics = httpx.get(f"{served}/metrics").text
    assert 'redbatch_gateway_requests_total{route="/v1/chat/completions",status="499"}' \
        in metrics


def test_a_finished_stream_is_deleted(served: str, r: redis.Redis) -> None:
    chunks = list(sdk(served).completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                 stream=True))
    request_id = chunks[0].id.removeprefix("cmpl-")
    deadline = time.monotonic() + 5
    while r.exists(protocol.token_stream_key("redbatch", request_id)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not r.exists(protocol.cancel_key("redbatch", request_id))


def test_the_timeout_cancels_the_generation(worker_factory: Callable[..., Any],
                                            gateway_factory: Any,  # noqa: F811
                                            tiny_path: Path, r: redis.Redis) -> None:
    """Not streamed: 504. Streamed: the chunks so far, then an error event the SDK raises.
    The request's deadline_ms is the gateway's timeout, so either side may end a generation
    first: the gateway by cancelling it ("within 0.4 s"), the worker by answering
    deadline_exceeded mid-generation; each streamed generation ends one way or the other."""
    options = {"path": str(tiny_path), "max_new_tokens": 16, "max_new_tokens_limit": 1000}
    with worker_factory(model=MODEL, model_options=options), \
            gateway_factory(request_timeout_s=0.4) as base_url:
        response = post(base_url, "completions", {"model": MODEL, "prompt": "the quick",
                                                  "max_tokens": 900})
        ids = []
        with pytest.raises(openai.APIError,
                           match="within 0.4 s|deadline passed while generating") as raised:
            for piece in sdk(base_url).completions.create(model=MODEL, prompt="the lazy",
                                                          max_tokens=900, stream=True):
                ids.append(piece.id.removeprefix("cmpl-"))
        metrics = httpx.get(f"{base_url}/metrics").text
    assert_openai_error(response, 504, "timeout")
    assert ids
    if "within 0.4 s" in str(raised.value):  # the gateway's timeout came first
        assert r.get(protocol.cancel_key("redbatch", ids[0])) == b"1"
        assert f"cancelled after {len(ids)} chunk(s) of text" in str(raised.value)
    assert 'redbatch_gateway_requests_total{route="/v1/completions",status="504"}' in metrics
