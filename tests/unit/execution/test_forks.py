"""The n-way sharing of a prompt's KV blocks (execution/kv_pool.py, execution/forks.py) and
the scheduler's hold on a fork until its source has the prompt cached (policy/decoding.py):
the pure parts, on a pool of a few blocks."""

from __future__ import annotations

import torch

from worker.execution.forks import shareable
from worker.execution.kv_pool import BLOCK_TOKENS, KVPool
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState, Work


def pool(blocks: int = 8) -> KVPool:
    return KVPool(1, 1, 2, tokens=blocks * BLOCK_TOKENS, dtype=torch.float32,
                  device=torch.device("cpu"))


def test_shared_blocks_are_free_only_once_every_holder_let_go() -> None:
    kv = pool()
    free = kv.free_tokens
    parent: list[int] = []
    kv.reserve(parent, 3 * BLOCK_TOKENS + 5)  # 3 whole blocks and a partial one
    children = [kv.share(parent, 3 * BLOCK_TOKENS) for _ in range(2)]
    assert children == [parent[:3], parent[:3]]
    for child in children:
        kv.reserve(child, 3 * BLOCK_TOKENS + 5)  # its own block for the partial one
        assert child[3] not in parent
    assert kv.free_tokens == free - 6 * BLOCK_TOKENS  # 4 + 1 + 1 blocks, not 12
    kv.release(parent)
    assert kv.free_tokens == free - 5 * BLOCK_TOKENS  # the shared three stay
    kv.release(children[0])
    assert kv.free_tokens == free - 4 * BLOCK_TOKENS
    kv.release(children[1])
    assert kv.free_tokens == free and sorted(kv._free) == list(range(1, kv.blocks))


def test_a_fork_shares_whole_blocks_before_the_prompts_last_token() -> None:
    prompt = list(range(3 * BLOCK_TOKENS))
    assert shareable(prompt, Work("c", 0, len(prompt), True)) == 2 * BLOCK_TOKENS
    assert shareable(prompt + [1], Work("c", 0, len(prompt) + 1, True)) == 3 * BLOCK_TOKENS
    assert shareable(prompt, Work("c", 0, BLOCK_TOKENS + 3, False)) == BLOCK_TOKENS
    assert shareable(prompt[:BLOCK_TOKENS], Work("c", 0, BLOCK_TOKENS, True)) == 0


def test_a_fork_waits_until_its_source_has_the_prompt_cached() -> None:
    scheduler = DecodingScheduler(SchedulerLimits(max_step_tokens=40, max_seqs=8))
    scheduler.add(SeqState("p", 60, 20))
    scheduler.add(SeqState("c1", 60, 4, after="p"))
    scheduler.add(SeqState("c2", 60, 4, after="p"))
    scheduler.add(SeqState("other", 10, 4))
    admitted: list[str] = []
    for _ in range(6):
        plan = scheduler.schedule()
        source = next(s for s in scheduler.running if s.id == "p")
        if {"c1", "c2"} & set(plan.admitted):  # only once its prompt is cached
            assert source.computed >= 60
        admitted += plan.admitted
        scheduler.update()
    assert admitted[0] == "p" and admitted.index("other") < admitted.index("c1")
    assert {"c1", "c2"} <= set(admitted)
    scheduler.remove("c1")
    scheduler.add(SeqState("orphan", 60, 4, after="gone"))  # its source is not here
    assert "orphan" in scheduler.schedule().admitted


def test_the_forks_first_steps_count_only_the_tokens_they_compute() -> None:
    """A 100-token prompt, 3 forks, 40 tokens a step: once the source has it cached, the
    forks start together, each computing 100 - 96 tokens (Work from 0: the engine shares
    the 96 first)."""
    scheduler = DecodingScheduler(SchedulerLimits(max_step_tokens=40, max_seqs=8,
                                                  prefill_first=False))
    scheduler.add(SeqState("p", 100, 20))
    for i in range(3):
        scheduler.add(SeqState(f"c{i}", 100, 4, after="p"))
    while True:
        plan = scheduler.schedule()
        scheduler.update()
        if plan.admitted != ["p"] and plan.admitted:
            break
    assert plan.admitted == ["c0", "c1", "c2"]
    assert [(w.start, w.end) for w in plan.prefill] == [(0, 100)] * 3
    assert [w.id for w in plan.decode] == ["p"]  # 1 + 3 x 4 tokens of a 40-token budget
