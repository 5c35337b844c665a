"""logprobs end to end: the official `openai` client, the gateway, a real Redis and a worker
serving the tiny GPT-2 (the rig of test_gateway_chat.py): chat's logprobs.content and
completions' four lists, streamed and not, the same either way; bad values 400 naming the
field."""

from __future__ import annotations

from typing import Any

from tests.e2e.test_gateway import assert_openai_error, gateway_factory, sdk  # noqa: F401
from tests.e2e.test_gateway_chat import MESSAGES, MODEL, post, served, tiny_path  # noqa: F401


def test_chat_and_completions_logprobs_streamed_and_not(served: str) -> None:  # noqa: F811
    client = sdk(served)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)
    assert b"".join(bytes(t.bytes or []) for t in content).decode(errors="replace") == \
        chat.choices[0].message.content
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    assert [t for part in streamed for t in part.content or []] == content
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == chat.choices[0].message.content

    text = client.completions.create(model=MODEL, prompt="hello redis", max_tokens=10,
                                     logprobs=2)
    lists = text.choices[0].logprobs
    assert lists is not None and lists.tokens and lists.token_logprobs and lists.text_offset
    assert len(lists.tokens) == len(lists.token_logprobs) == len(lists.text_offset)
    assert lists.text_offset[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(lists.text_offset, lists.text_offset[1:],
                                           lists.tokens, strict=False))
    assert all(1 <= len(top) <= 2 for top in lists.top_logprobs or [])
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="hello redis", max_tokens=10, logprobs=2, stream=True)
        if c.choices[0].logprobs]
    assert [o for c in chunks for o in c.text_offset or []] == lists.text_offset
    assert [v for c in chunks for v in c.token_logprobs or []] == lists.token_logprobs


def test_bad_logprob_values_are_400_naming_the_field(served: str) -> None:  # noqa: F811
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1000},
         "top_logprobs"),
        ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ]
    for route, body, param in cases:
        for stream in (False, True):
            error = assert_openai_error(post(served, route, {"model": MODEL, **body,
                                                             "stream": stream}),
                                        400, "invalid_request")
            assert error["param"] == param, (body, error)
