"""Generations survive their worker: resume from the reply stream, keep-alive, SIGTERM.

Real `python -m worker` processes on the tiny GPT-2 (tests/rigs/tiny_lm.py), a real Redis. The kill
trials print a DURABILITY line with their figures (pytest -s); DURABILITY_TRIALS sets how many.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from producer import protocol
from tests.redis.single.test_generation_e2e import generated_text, send, stream_key
from tests.rigs.chaos import WorkerProcess, heaviest_on_redis_7_only, wait_until
from tests.rigs.tiny_lm import build_tiny_lm, engine_text
from worker.execution.detokenize import TextState
from worker.execution.generation import GenerationEngine
from worker.models.generation_params import SamplingParams
from worker.policy.decoding import DecodingScheduler, SchedulerLimits, SeqState
from worker.streams.token_streams import Chunk, FinalChunk, TokenStreams, progress_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STREAM = "redbatch:requests:causal_lm"
PROMPTS = ["the quick brown fox", "redis streams carry requests", "hello world, hello",
           "what is the capital of", "continuous batching lets new", "the lazy dog"]
NEW_TOKENS = 100
TRIAL_TOKENS = 40  # about a second of generation on two loaded cores
TRIALS = int(os.environ.get("DURABILITY_TRIALS", "8"))  # 20 take ~100 s on 2 cores
Spawn = Callable[..., WorkerProcess]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_lm(tmp_path_factory.mktemp("tiny-durable"))


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_path).eval(), \
        AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture
def spawn(tmp_path: Path, tiny_path: Path, redis_url: str) -> Iterator[Spawn]:
    started: list[WorkerProcess] = []

    def start(name: str, claim_idle_ms: int = 600, max_seqs: int = 16,
              *flags: str, step_ms: float | None = None,
              overlap_steps: bool | None = None) -> WorkerProcess:
        """`step_ms`: each decoding step takes at least that long (tests.rigs.plugin_models)."""
        options: dict[str, Any] = {"path": str(tiny_path), "max_new_tokens": 16,
                                   "max_new_tokens_limit": 120, "max_seqs": max_seqs,
                                   "overlap_steps": overlap_steps}
        model = "causal_lm"
        if step_ms is not None:
            model, options["step_ms"] = "tests.rigs.plugin_models:SlowStepLM", step_ms
        started.append(WorkerProcess(
            redis_url, tmp_path / f"{name}-{len(started)}.log", "--model", model,
            "--model-name", "causal_lm",
            "--model-options", json.dumps(options), "--consumer", name,
            "--claim-idle-ms", str(claim_idle_ms), "--block-ms", "100",
            "--max-inflight", "64", "--maintenance-interval-s", "0.5", *flags))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


def entries_of(r: redis.Redis, key: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for entry_id, fields in r.xrange(key):
        data = fields[b"data"]
        out.append((entry_id.decode(), protocol.decode(
            data, protocol.JSON if data[:1] == b"{" else protocol.MSGPACK)))
    return out


def is_done(r: redis.Redis, key: str) -> bool:
    last = r.xrevrange(key, count=1)
    return bool(last) and b'"type":"done"' in last[0][1][b"data"].replace(b" ", b"")


def wait_done(r: redis.Redis, keys: list[str], timeout: float) -> float:
    wait_until(lambda: all(is_done(r, k) for k in keys), timeout, "every done entry", 0.01)
    return time.monotonic()


def check_stream(r: redis.Redis, key: str, expected: str) -> dict[str, int]:
    """Contiguous ids 1-1, 2-1, ..., each index once, text as expected; the figures."""
    entries = entries_of(r, key)
    ids = [i for i, _ in entries]
    indices = [e["index"] for _, e in entries[:-1]]
    wanted = [f"{n}-1" for n in range(1, len(entries) + 1)]
    done = entries[-1][1]
    text = "".join(e["text"] for _, e in entries[:-1])
    return {"missing": len(set(wanted) - set(ids)) + len(set(range(1, len(indices) + 1))
                                                        - set(indices)),
            "repeated": len(indices) - len(set(indices)) + len(ids) - len(set(ids)),
            "complete": int(done["type"] == "done" and done["ok"] and ids == wanted),
            "identical": int(text == done["result"]["text"] == expected),
            "resumed": int("resumed_at" in done["meta"])}


SEEDED = {"temperature": 0.9, "top_k": 40}


# --- in process -------------------------------------------------------------------------------


def test_the_engine_resumed_after_some_tokens_continues_as_uninterrupted(
        reference: tuple[Any, Any]) -> None:
    lm, tokenizer = reference
    for params in (SamplingParams(40), SamplingParams(40, 0.9, top_k=40, seed=7)):
        ids = list(tokenizer(PROMPTS[0]).input_ids)
        full = GenerationEngine(lm, tokenizer, torch.device("cpu"), {tokenizer.eos_token_id})
        scheduler = DecodingScheduler(SchedulerLimits())
        full.add("a", ids, params)
        scheduler.add(SeqState("a", len(ids), params.max_new_tokens))
        while len(scheduler):
            plan = scheduler.schedule()
            scheduler.update(full.step(plan).finished)
        tokens = full.seqs["a"].text.generated
        assert len(tokens) > 15
        resumed = GenerationEngine(lm, tokenizer, torch.device("cpu"), {tokenizer.eos_token_id})
        resumed.add("b", ids, params, entropy=99)
        sent = full.decode(tokens[:15])
        assert resumed.resume("b", tokens[:15], sent) is None
        scheduler.add(SeqState("b", len(ids), params.max_new_tokens, generated=15))
        while len(scheduler):
            plan = scheduler.schedule()
            scheduler.update(resumed.step(plan).finished)
        assert resumed.seqs["b"].text.generated == tokens
        assert resumed.seqs["b"].text.text == full.seqs["a"].text.text


def test_resume_notices_a_generation_that_had_already_ended() -> None:
    def decode(ids: Any) -> str:
        return "".join(chr(97 + i) for i in ids if i != 0)

    assert TextState(SamplingParams(3), frozenset({0})).resume([1, 2, 3], "abc",
                                                               decode) == "length"
    assert TextState(SamplingParams(9), frozenset({0})).resume([1, 0], "b", decode) == "stop"
    state = TextState(SamplingParams(9, stop=("cd",)), frozenset({0}))
    assert state.resume([1, 2, 3, 4], "bc"[:1], decode) == "stop" and state.text == "b"
    state = TextState(SamplingParams(9), frozenset({0}))
    assert state.resume([1, 2], "bc", decode) is None and state.sent_chars == 2


def test_progress_reads_deltas_and_done() -> None:
    delta = {"id": "r", "type": "delta", "index": 1, "text": "ab", "token_ids": [1, 2]}
    entries = [(b"1-1", {b"data": json.dumps(delta).encode()}),
               (b"2-1", {b"data": protocol.encode({**delta, "index": 2, "text": "c",
                                                   "token_ids": [3]}, protocol.MSGPACK)}),
               (b"3-1", {b"junk": b""})]
    found = progress_of(entries)
    assert (found.chunks, found.token_ids, found.text, found.done) == (2, [1, 2, 3], "abc", None)
    entries.append((b"4-1", {b"data": json.dumps({"id": "r", "type": "done", "ok": True})
                             .encode()}))
    assert progress_of(entries).done_index == 4
    assert progress_of(redis.ResponseError("WRONGTYPE")).chunks == 0


def test_progress_stops_past_the_tokens_a_worker_could_have_written() -> None:
    delta = {"id": "r", "type": "delta", "text": "ab", "token_ids": [1, 2]}
    entries = [(f"{n}-1".encode(), {b"data": json.dumps(delta).encode()}) for n in range(1, 9)]
    assert not progress_of(entries, max_tokens=16).overfull
    found = progress_of(entries, max_tokens=5)
    assert found.overfull and (found.chunks, len(found.token_ids)) == (3, 6)


@pytest.mark.parametrize("forged", [{"text": 5}, {"token_ids": "abc"}, {"token_ids": [-1]},
                                    {"token_ids": [1 << 40]}, {"token_ids": [True]},
                                    {"token_ids": [[1]]}, {"token_ids": [1.5]}])
def test_progress_skips_a_delta_no_worker_wrote(forged: dict[str, Any]) -> None:
    """Producers can write a reply stream too: what a resume reads is checked, and a
    malformed delta is skipped rather than crashing the loop or reaching the model."""
    delta = {"id": "r", "type": "delta", "text": "ab", "token_ids": [1, 2]}
    entries = [(b"1-1", {b"data": json.dumps(delta).encode()}),
               (b"2-1", {b"data": json.dumps({**delta, **forged}).encode()})]
    found = progress_of(entries)
    assert (found.chunks, found.token_ids, found.text) == (1, [1, 2], "ab")


def test_keep_alive_claims_only_our_own_entries_without_counting_a_delivery(
        r: redis.Redis) -> None:
    r.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    ids = [r.xadd(STREAM, {"n": i}).decode() for i in range(3)]
    r.xreadgroup("workers", "w1", {STREAM: ">"}, count=2)
    r.xreadgroup("workers", "w2", {STREAM: ">"}, count=1)
    time.sleep(0.05)
    streams = TokenStreams(r, STREAM, "workers", "w1", 1000, "answered")
    assert streams.keep_alive(ids) == [ids[2]]
    rows = {row["message_id"].decode(): row for row in
            r.xpending_range(STREAM, "workers", "-", "+", 10)}
    assert [rows[i]["consumer"] for i in ids] == [b"w1", b"w1", b"w2"]
    assert all(rows[i]["times_delivered"] == 1 for i in ids)
    # ids[0] was claimed afresh after the 50 ms sleep, ids[2] not (one reply, no clock here)
    idle = {i: rows[i]["time_since_delivered"] for i in ids}
    assert idle[ids[2]] - idle[ids[0]] >= 45 and idle[ids[2]] >= 50
    assert streams.keep_alive([]) == []


def test_a_done_entry_goes_after_a_previous_owners_chunks_or_only_acks(
        r: redis.Redis) -> None:
    r.xgroup_create(STREAM, "workers", id="0", mkstream=True)
    first, second = (r.xadd(STREAM, {"n": i}).decode() for i in range(2))
    r.xreadgroup("workers", "w1", {STREAM: ">"})
    delta = json.dumps({"id": "r", "type": "delta", "index": 1, "text": "a"}).encode()
    done = protocol.encode({"id": "r", "type": "done", "ok": True}, protocol.MSGPACK)
    r.xadd("s:a", {"data": delta}, id="1-1")
    r.xadd("s:a", {"data": delta}, id="2-1")
    r.xadd("s:b", {"data": delta}, id="1-1")
    r.xadd("s:b", {"data": done}, id="2-1")
    streams = TokenStreams(r, STREAM, "workers", "w1", 1000, "answered")
    assert streams.finish([FinalChunk(first, Chunk("s:a", 1, done)),
                           FinalChunk(second, Chunk("s:b", 2, done))]) == []
    assert [e[0] for e in r.xrange("s:a")] == [b"1-1", b"2-1", b"3-1"]
    assert r.xlen("s:b") == 2 and r.xpending(STREAM, "workers")["pending"] == 0


# --- worker processes -------------------------------------------------------------------------


def submit_trial(r: redis.Redis, trial: int) -> list[tuple[str, dict[str, Any]]]:
    """Three greedy requests and one seeded one."""
    sent = []
    for k in range(4):
        payload: dict[str, Any] = {"prompt": PROMPTS[(trial + k) % len(PROMPTS)],
                                   "max_new_tokens": TRIAL_TOKENS}
        if k == 3:
            payload.update(SEEDED, seed=trial)
        sent.append((send(r, payload), payload))
    return sent


def expected_text(reference: tuple[Any, Any], payload: dict[str, Any]) -> str:
    if "seed" not in payload:
        return generated_text(*reference, payload["prompt"], payload["max_new_tokens"])
    params = SamplingParams(payload["max_new_tokens"], payload["temperature"],
                            top_k=payload["top_k"], seed=payload["seed"])
    return engine_text(*reference, payload["prompt"], params)


def kill_mid_generation(r: redis.Redis, workers: dict[str, WorkerProcess],
                        keys: list[str]) -> tuple[str, int]:
    """Once a live worker holds an unfinished stream with a few chunks, kill -9 it (so the
    kill lands mid-generation of its own streams); returns it and how many streams were then
    unfinished."""
    def busy_victim() -> str | None:
        held = held_streams(r)
        live = [n for n in held if workers[n].process.poll() is None]
        started = [n for n in live if any(r.xlen(k) >= 3 and not is_done(r, k) for k in held[n])]
        return max(started, key=lambda n: len(held[n])) if started else None

    wait_until(lambda: busy_victim() is not None, 30, "a held stream with chunks", 0.002)
    victim = busy_victim() or next(iter(workers))
    workers[victim].process.kill()
    workers[victim].process.wait(10)
    return victim, sum(not is_done(r, k) for k in keys)


def held_streams(r: redis.Redis) -> dict[str, list[str]]:
    """Each consumer's pending entries, as the reply streams of their requests."""
    held: dict[str, list[str]] = {}
    for pending in r.xpending_range(STREAM, "workers", "-", "+", 1000):
        entry = r.xrange(STREAM, pending["message_id"], pending["message_id"])
        if entry:
            held.setdefault(pending["consumer"].decode(), []).append(
                stream_key(entry[0][1][b"id"].decode()))
    return held


@pytest.mark.slow
def test_kill_9_mid_generation_every_stream_resumes_whole_and_identical(
        spawn: Spawn, r: redis.Redis, reference: tuple[Any, Any]) -> None:
    heaviest_on_redis_7_only(r)
    kill_trials(spawn, r, reference, TRIALS)


@pytest.mark.slow
def test_kill_9_mid_generation_with_overlapped_steps_resumes_whole_and_identical(
        spawn: Spawn, r: redis.Redis, reference: tuple[Any, Any]) -> None:
    """As above, the workers' steps overlapped as on a GPU (a step's tokens are read while
    the next one runs, so a kill lands with a step in flight); half the trials (~30 s)."""
    heaviest_on_redis_7_only(r)
    kill_trials(spawn, r, reference, max(2, TRIALS // 2), overlap_steps=True)


def kill_trials(spawn: Spawn, r: redis.Redis, reference: tuple[Any, Any], trials: int,
                overlap_steps: bool | None = None) -> None:
    """Three workers; each trial sends a mix of generations, kill -9s the busiest worker
    mid-generation and restarts it: every stream ends whole and as uninterrupted."""
    def start(name: str) -> WorkerProcess:
        return spawn(name, overlap_steps=overlap_steps)

    workers = {name: start(name) for name in ("w0", "w1", "w2")}
    for worker in workers.values():
        worker.wait_serving()
    overlapped = f'"overlapped_steps": {"true" if overlap_steps else "false"}'
    assert all(overlapped in w.log.read_text() for w in workers.values())
    totals = {"streams": 0, "interrupted": 0, "complete": 0, "identical": 0, "missing": 0,
              "repeated": 0, "resumed": 0}
    recoveries, started = [], time.monotonic()
    for trial in range(trials):
        wait_until(lambda: sum(w.logged("worker.serving") and w.process.poll() is None
                               for w in workers.values()) >= 2, 60, "two serving workers")
        sent = submit_trial(r, trial)
        keys = [stream_key(i) for i, _ in sent]
        victim, interrupted = kill_mid_generation(r, workers, keys)
        killed_at = time.monotonic()
        workers[victim] = start(victim)  # the restarted one drains its own pending entries
        recoveries.append(wait_done(r, keys, 60) - killed_at)
        totals["streams"] += len(keys)
        totals["interrupted"] += interrupted
        for key, (_, payload) in zip(keys, sent, strict=True):
            for name, value in check_stream(r, key, expected_text(reference, payload)).items():
                totals[name] += value
    wait_until(lambda: r.xpending(STREAM, "workers")["pending"] == 0, 10, "all acked")
    print(f"\nDURABILITY kill-9 (overlap_steps={overlap_steps}): trials={trials} {totals} "
          f"recovery_s max={max(recoveries):.2f} mean={sum(recoveries) / len(recoveries):.2f} "
          f"total_s={time.monotonic() - started:.1f}", flush=True)
    assert totals["complete"] == totals["identical"] == totals["streams"]
    assert totals["missing"] == totals["repeated"] == 0
    assert totals["resumed"] >= trials // 2  # most kills did land mid-generation


@pytest.mark.slow
def test_a_long_generation_on_a_live_worker_is_not_claimed_by_another(
        spawn: Spawn, r: redis.Redis) -> None:
    heaviest_on_redis_7_only(r)
    claim_idle_ms = 2000  # keep-alive every 667 ms: a stall of the loop up to 1.3 s is fine
    # 4 generations a worker of 40 steps of at least 25 ms each, one at a time: 4 s or
    # more (few steps: each step's compute on loaded cores, ~25 ms, adds as much again)
    workers = [spawn(n, claim_idle_ms, 1, step_ms=25.0) for n in ("a", "b")]
    for worker in workers:
        worker.wait_serving()
    started = time.monotonic()
    ids = [send(r, {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": TRIAL_TOKENS})
           for i in range(8)]
    seen: dict[str, set[str]] = {}
    delivered = 1

    def finished() -> bool:
        nonlocal delivered
        for row in r.xpending_range(STREAM, "workers", "-", "+", 100):
            seen.setdefault(row["message_id"].decode(), set()).add(row["consumer"].decode())
            delivered = max(delivered, row["times_delivered"])
        return all(is_done(r, stream_key(i)) for i in ids)

    wait_until(finished, 120, "every done entry", 0.01)
    took_ms = (time.monotonic() - started) * 1000
    assert took_ms > 1.5 * claim_idle_ms, "too quick to tell: make the generations longer"
    assert all(len(owner) == 1 for owner in seen.values()), seen
    assert delivered == 1
    for request_id in ids:
        done = entries_of(r, stream_key(request_id))[-1][1]
        assert "resumed_at" not in done["meta"]
    assert not any(w.logged("entries.claimed") or w.logged("generate.lost") for w in workers)


@pytest.mark.slow
def test_sigterm_finishes_within_the_grace_or_leaves_the_rest_to_resume(
        spawn: Spawn, r: redis.Redis, reference: tuple[Any, Any]) -> None:
    # steps of at least 20 ms: the short one takes some 0.2 s of the 1 s grace, and a long
    # one (2 s or more) is cut by it, on any host
    leaving = spawn("leaving", 500, 1, "--shutdown-grace-s", "1.0", step_ms=20.0).wait_serving()
    # a short one, done within the grace; long ones, cut by it
    sent = [(send(r, p), p) for p in ({"prompt": PROMPTS[i % 6],
                                       "max_new_tokens": 8 if i == 0 else NEW_TOKENS,
                                       **({"seed": i, **SEEDED} if i % 2 else {})}
                                      for i in range(10))]
    keys = [stream_key(i) for i, _ in sent]
    wait_until(lambda: r.xlen(keys[0]) >= 1, 30, "first chunks", 0.002)
    leaving.signal(signal.SIGTERM)
    assert leaving.process.wait(10) == 0
    by_leaver = sum(is_done(r, k) for k in keys)
    spawn("staying", 500).wait_serving()
    wait_done(r, keys, 60)
    figures = [check_stream(r, k, expected_text(reference, p)) for k, (_, p) in zip(
        keys, sent, strict=True)]
    assert all(f["complete"] and f["identical"] and not f["missing"] and not f["repeated"]
               for f in figures), figures
    workers = [entries_of(r, k)[-1][1]["meta"]["worker"] for k in keys]
    assert workers.count("leaving") == by_leaver >= 1 and "staying" in workers
    assert sum(f["resumed"] for f in figures) >= 1
    wait_until(lambda: r.xpending(STREAM, "workers")["pending"] == 0, 10, "all acked")
    print(f"\nDURABILITY sigterm: finished_in_grace={by_leaver} resumed="
          f"{sum(f['resumed'] for f in figures)} of {len(keys)}", flush=True)
