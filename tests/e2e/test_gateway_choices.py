"""n > 1 and lists of prompts end to end: the official `openai` client, the gateway, a real
Redis and a worker serving the tiny GPT-2 (the rig of test_gateway_chat.py). Choice j of a
seeded request is that request alone with seed + j; streamed choices carry their index and
join to the unstreamed ones; a list of prompts is answered prompt-major."""

from __future__ import annotations

from tests.e2e.test_gateway import assert_openai_error, gateway_factory, sdk  # noqa: F401
from tests.e2e.test_gateway_chat import MESSAGES, MODEL, post, served, tiny_path  # noqa: F401

SAMPLING = {"max_tokens": 10, "temperature": 1.0, "seed": 5}


def test_chat_n_3_streamed_and_not_equals_each_seed_alone(served: str) -> None:  # noqa: F811
    client = sdk(served)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **SAMPLING)
    texts = [c.message.content for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2] and len(set(texts)) > 1
    alone = [client.chat.completions.create(model=MODEL, messages=MESSAGES, **{
        **SAMPLING, "seed": 5 + j}) for j in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert answer.usage is not None and all(a.usage is not None for a in alone)
    assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone
                                                 if a.usage)
    assert answer.usage.prompt_tokens == alone[0].usage.prompt_tokens  # type: ignore[union-attr]
    streamed = ["", "", ""]
    finished = [None, None, None]
    for part in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3,
                                               stream=True, **SAMPLING):
        for choice in part.choices:
            streamed[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert streamed == texts and finished == [c.finish_reason for c in answer.choices]


def test_a_list_of_two_prompts_with_n_2_is_prompt_major(served: str) -> None:  # noqa: F811
    client = sdk(served)
    prompts = ["hello redis", "the quick brown"]
    answer = client.completions.create(model=MODEL, prompt=prompts, n=2, **SAMPLING)
    alone = [client.completions.create(model=MODEL, prompt=p, **{**SAMPLING, "seed": 5 + j}
                                       ).choices[0].text for p in prompts for j in range(2)]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == alone
    streamed = [""] * 4
    for part in client.completions.create(model=MODEL, prompt=prompts, n=2, stream=True,
                                          stream_options={"include_usage": True},
                                          **SAMPLING):
        for choice in part.choices:
            streamed[choice.index] += choice.text
        last = part
    assert streamed == alone and last.usage == answer.usage
    error = assert_openai_error(post(served, "completions", {
        "model": MODEL, "prompt": ["x"] * 9, "n": 2}), 400, "invalid_request")
    assert error["param"] == "n"


def test_the_choices_of_a_long_prompt_share_its_kv_blocks(served: str) -> None:  # noqa: F811
    """The worker here runs in this process: its counter of shared prompt tokens is read."""
    from prometheus_client import REGISTRY

    def counted() -> float:
        return REGISTRY.get_sample_value("redbatch_prompt_tokens_shared_total") or 0.0

    client = sdk(served)
    prompt = "the quick brown fox jumps over the lazy dog, " * 6
    before = counted()
    answer = client.completions.create(model=MODEL, prompt=prompt, n=3, **SAMPLING)
    shared = counted() - before
    tokens = answer.usage.prompt_tokens if answer.usage else 0
    assert shared == 2 * ((tokens - 1) // 16 * 16) > 0
    alone = [client.completions.create(model=MODEL, prompt=prompt, **{
        **SAMPLING, "seed": 5 + j}).choices[0].text for j in range(3)]
    assert [c.text for c in answer.choices] == alone
