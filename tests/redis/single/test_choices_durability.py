"""kill -9 of a worker in the middle of an n = 3 request: the official `openai` client streams
it through a real gateway; another worker resumes the killed worker's choices from their
reply streams, and every choice is answered once, whole, with the text of its seed alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import redis

from tests.e2e.test_gateway import gateway_factory, sdk  # noqa: F401
from tests.redis.single.test_generation_durability import (  # noqa: F401
    Spawn,
    held_streams,
    is_done,
    spawn,
    tiny_path,
)
from tests.rigs.chaos import heaviest_on_redis_7_only, wait_until

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
SAMPLING: dict[str, Any] = {"max_tokens": 30, "temperature": 1.0, "seed": 5}


def test_kill_9_mid_n_3_request_every_choice_answered_once(
        spawn: Spawn, r: redis.Redis, gateway_factory: Any,  # noqa: F811
        tmp_path: Path) -> None:
    heaviest_on_redis_7_only(r)
    workers = {name: spawn(name, 600, 16, step_ms=15.0) for name in ("a", "b")}
    for worker in workers.values():
        worker.wait_serving()
    with gateway_factory() as base_url:
        client = sdk(base_url)
        texts, reasons = [""] * 3, [0] * 3
        failure: list[BaseException] = []

        def read() -> None:
            try:
                for part in client.chat.completions.create(
                        model="causal_lm", messages=MESSAGES, n=3, stream=True, **SAMPLING):
                    for choice in part.choices:
                        texts[choice.index] += choice.delta.content or ""
                        reasons[choice.index] += choice.finish_reason is not None
            except BaseException as exc:  # reported by the test's thread
                failure.append(exc)

        reader = threading.Thread(target=read)
        reader.start()

        def busy() -> str | None:
            held = held_streams(r)
            started = [n for n in held if any(r.xlen(k) >= 3 and not is_done(r, k)
                                              for k in held[n])]
            return max(started, key=lambda n: len(held[n])) if started else None

        wait_until(lambda: busy() is not None, 30, "a held stream with chunks", 0.002)
        victim = busy()
        assert victim is not None
        workers[victim].process.kill()
        workers[victim].process.wait(10)
        killed = time.monotonic()
        reader.join(60)
        assert not reader.is_alive() and not failure, failure
        assert time.monotonic() - killed < 30
        alone = [client.chat.completions.create(model="causal_lm", messages=MESSAGES, **{
            **SAMPLING, "seed": 5 + j}).choices[0].message.content for j in range(3)]
    assert reasons == [1, 1, 1] and texts == alone
    survivor = next(w for name, w in workers.items() if name != victim)
    assert survivor.logged("generate.resumed")
