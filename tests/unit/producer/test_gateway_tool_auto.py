"""`tool_choice` "auto" in the gateway (tool_auto.py, tool_calls.py): the Lark grammar it
sends, compiled by the worker's GrammarCompiler on the tiny model's tokenizer and walked
token by token (text and a marked call pass, a wrong call is refused, seeded random walks
reach both branches); the answer read back as text, a call or a cut call; and the stream's
hold on deltas that may still become the call marker."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from producer.gateway.generation_shapes import (
    completion_response,
    parse_chat_request,
    tool_call_chunk,
)
from producer.gateway.tool_auto import CLOSE, OPEN, MarkerHold, marked_call
from tests.rigs.tiny_lm import build_tiny_lm
from worker.models.structured_params import constraint_of
from worker.pipeline.grammars import GrammarCompiler, random_token

VOCAB = 320
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "add 2 and 3"}], "tools": TOOLS}
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_lm(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def matcher(tokenizer: Any) -> Iterator[Any]:
    """The compiled grammar of an "auto" request, as the worker builds it."""
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    constraint = constraint_of(parse_chat_request(CHAT).payload)
    assert constraint is not None and constraint.kind == "lark"
    compiled = compiler.compile(constraint).result(timeout=30)
    assert not isinstance(compiled, str), compiled  # compiled, and passed the probe walk
    yield compiled
    compiler.close()


def walk(matcher: Any, tokenizer: Any, text: str) -> str:
    """"end" when the grammar takes `text` whole and may end there, "open" when it takes it
    but wants more, "refused" when a token is refused."""
    fresh = matcher.deep_copy()
    for token in tokenizer.encode(text):
        if not fresh.consume_token(token):
            return "refused"
    return "end" if fresh.is_accepting() else "open"


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_sends_a_lark_grammar_and_describes_the_marker(choice: str | None) -> None:
    request = parse_chat_request({**CHAT, "tool_choice": choice})
    grammar = request.payload["structured_outputs"]["grammar"]
    assert request.tool_call and request.tool_auto and "json" not in request.payload[
        "structured_outputs"]
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"const": "add"},
                                                                 {"const": "now"}]
    jsonschema.validate(json.loads(CALL), schema)
    system = request.payload["messages"][0]
    assert system["role"] == "system" and OPEN in system["content"] and \
        "plain text" in system["content"] and '"name": "add"' in system["content"]
    forced = parse_chat_request({**CHAT, "tool_choice": "required"})
    assert not forced.tool_auto and "json" in forced.payload["structured_outputs"]


def test_the_grammar_takes_text_or_one_marked_call(matcher: Any, tokenizer: Any) -> None:
    for text in ("paris is the capital", "", "<tool", "a <tool_call> in text",
                 f"{OPEN}{CALL}{CLOSE}", f"\n{OPEN}\n{CALL}\n{CLOSE}"):
        assert walk(matcher, tokenizer, text) == "end", text
    assert walk(matcher, tokenizer, f"{OPEN}{CALL}") == "open"
    for text in (f"{OPEN}hello", f'{OPEN}{{"name": "sub", "arguments": {{}}}}{CLOSE}',
                 f'{OPEN}{{"name": "add", "arguments": {{"a": 2}}}}{CLOSE}',
                 f"{OPEN}{CALL}{CLOSE} and more", f" {OPEN}x"):
        assert walk(matcher, tokenizer, text) == "refused", text


def test_random_walks_reach_text_and_whole_calls(matcher: Any, tokenizer: Any) -> None:
    """Tokens drawn at random among those allowed (EOS where allowed, 1 in 10), half the
    walks started with the marker: both branches come out, every whole call valid."""
    rng, eos, kinds = random.Random(0), [tokenizer.eos_token_id], set()
    for run in range(40):
        walker, tokens = matcher.deep_copy(), tokenizer.encode(OPEN) if run % 2 else []
        assert walker.consume_tokens(tokens)
        for _ in range(150):
            mask = walker.compute_bitmask()
            token = random_token(mask, rng, eos)
            if walker.is_stopped() or token is None or \
                    (walker.is_accepting() and rng.random() < 0.1):
                break
            assert walker.consume_token(token)
            tokens.append(token)
        text = tokenizer.decode(tokens)
        body = marked_call(text)
        if walker.is_accepting():
            kinds.add("call" if body is not None else "text")
        if body is not None:
            call = json.loads(body)
            assert call["name"] in ("add", "now") and isinstance(call["arguments"], dict)
    assert kinds == {"call", "text"}


def answer(text: str, reason: str = "stop") -> dict[str, Any]:
    request = parse_chat_request(CHAT)
    return completion_response(request, "r1", 0, {"text": text, "finish_reason": reason})[
        "choices"][0]


def test_an_auto_answer_is_text_a_call_or_a_cut_call() -> None:
    text = answer("paris is the capital")
    assert text["finish_reason"] == "stop" and text["message"] == {
        "role": "assistant", "content": "paris is the capital"}
    assert answer("paris", "length")["finish_reason"] == "length"
    for marked in (f"{OPEN}{CALL}{CLOSE}", f"\n{OPEN}\n{CALL}\n{CLOSE}\n"):
        call = answer(marked)
        assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
        entry = call["message"]["tool_calls"][0]
        assert entry["id"].startswith("call_") and entry["type"] == "function"
        assert entry["function"]["name"] == "add"
        assert json.loads(entry["function"]["arguments"]) == {"a": 2, "b": 3}
    cut = answer(f"{OPEN}{CALL[:12]}", "length")
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == \
        f"{OPEN}{CALL[:12]}" and "tool_calls" not in cut["message"]
    request = parse_chat_request(CHAT)
    streamed = tool_call_chunk(request, "r1", 0, f"{OPEN}{CALL}{CLOSE}")
    assert streamed is not None and streamed[1] == "tool_calls"
    assert tool_call_chunk(request, "r1", 0, CALL) is None  # unmarked: text


def deltas(hold: MarkerHold, *texts: str) -> list[str]:
    return [d["text"] for t in texts for d in hold.take({"text": t})]


def test_the_stream_holds_what_may_still_be_the_marker() -> None:
    hold = MarkerHold()
    assert deltas(hold, "\n", "<to", "ol") == [] and not hold.is_call()
    assert deltas(hold, "s are", " fun") == ["\n", "<to", "ol", "s are", " fun"]
    assert hold.flush() == []
    call = MarkerHold()
    assert deltas(call, "<tool", "_call>", CALL, CLOSE) == [] and call.is_call()
    assert call.flush() == []  # sent whole at the end, never as text
    short = MarkerHold()
    assert deltas(short, "<tool") == [] and [d["text"] for d in short.flush()] == ["<tool"]


def test_a_batch_line_gets_the_same_auto_grammar_and_answers() -> None:
    from producer.batches.lines import InputLine, work_of

    work = work_of(InputLine("c1", "/v1/chat/completions", dict(CHAT)), 16, 0)
    assert "grammar" in work.payloads[0]["structured_outputs"]
    body = work.shape("r1", [{"text": f"{OPEN}{CALL}{CLOSE}", "finish_reason": "stop"}])
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    text = work.shape("r1", [{"text": "hello", "finish_reason": "length"}])["choices"][0]
    assert text["finish_reason"] == "length" and text["message"]["content"] == "hello"


@pytest.mark.parametrize("choice", [None, "required"])
def test_tools_too_deep_or_too_big_are_400_naming_tools(choice: str | None) -> None:
    from producer.gateway.errors import ApiError

    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9000)}}
    for parameters in (deep, big):
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        with pytest.raises(ApiError) as refused:
            parse_chat_request({**CHAT, "tools": tools, "tool_choice": choice})
        assert refused.value.status == 400 and refused.value.param == "tools"
