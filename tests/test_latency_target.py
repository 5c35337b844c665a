"""`latency_target_ms` end to end, through Redis, on the echo cost model: under a load step
the target is held, a deadline that cannot be met is answered at read time, and with
`shed_over_target` an overload is refused with `overloaded` and retry_after_ms."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis
from prometheus_client import REGISTRY

from producer import Client

TARGET_MS = 300.0


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def paced(client: Client, rate_per_s: float, seconds: float, reply_to: str) -> list[str]:
    """Submit at a steady rate (open loop); returns the request ids."""
    ids: list[str] = []
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        due = int(elapsed * rate_per_s) + 1 - len(ids)
        if due > 0:
            ids += client.submit_many([{"n": len(ids) + i} for i in range(due)],
                                      reply_to=reply_to)
        time.sleep(0.005)
    return ids


def test_a_load_step_holds_the_target(redis_url: str, r: redis.Redis,
                                      worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "echo")
    reply_to = client.new_reply_key()
    with worker_factory(model_options={"delay_ms": 10, "per_item_ms": 1},
                        latency_target_ms=TARGET_MS, instances=2):
        ids = paced(client, 40, 1.5, reply_to) + paced(client, 300, 2.0, reply_to)
        envelopes = client.collect(reply_to, len(ids), timeout=30)
    assert len(envelopes) == len(ids) and all(e["ok"] for e in envelopes)
    waits = sorted(e["meta"]["queue_ms"] + e["meta"]["compute_ms"] for e in envelopes)
    assert waits[int(0.99 * len(waits))] <= TARGET_MS
    reasons = {s.labels["reason"] for m in REGISTRY.collect() if m.name == "redbatch_dispatches"
               for s in m.samples if s.labels.get("model") == "echo"}
    assert reasons & {"wait_paid_off", "waiting", "full", "deadline"}
    assert metric("redbatch_latency_target_seconds", model="echo") == TARGET_MS / 1000
    # the fit learnt the echo cost model: about 10 ms per batch, 1 ms per (padded) request
    assert 0.004 < metric("redbatch_service_cost_seconds", model="echo", term="fixed") < 0.03
    assert 0 < metric("redbatch_latency_observed_seconds", model="echo") <= TARGET_MS / 1000


def test_a_deadline_that_cannot_be_met_is_answered_when_read(
        redis_url: str, worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "echo")
    with worker_factory(model_options={"delay_ms": 150}, max_batch_size=2, instances=1,
                        latency_target_ms=60_000.0):
        for request_id in client.submit_many([{"n": i} for i in range(8)]):
            client.wait(request_id, timeout=30)
        backlog = client.submit_many([{"n": i} for i in range(12)])  # ~900 ms of batches
        time.sleep(0.1)
        sent = time.monotonic()
        hopeless = client.submit({"late": True}, deadline_ms=int(time.time() * 1000) + 300)
        envelope = client.wait(hopeless, timeout=30)
        answered_in = time.monotonic() - sent
        assert all(client.wait(i, timeout=30)["ok"] for i in backlog)
    assert envelope["error"]["code"] == "deadline_exceeded"
    assert "cannot meet its deadline" in envelope["error"]["message"]
    assert answered_in < 0.3  # at read time, not after waiting in a bucket


def test_overload_is_shed_with_a_retry_time(redis_url: str,
                                            worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "echo")
    refused_before = metric("redbatch_refused_total", model="echo", code="overloaded")
    with worker_factory(model_options={"delay_ms": 100}, max_batch_size=2, instances=1,
                        latency_target_ms=400.0, shed_over_target=True):
        for request_id in client.submit_many([{"n": i} for i in range(6)]):
            client.wait(request_id, timeout=30)
        burst = client.submit_many([{"n": i} for i in range(60)])
        envelopes = [client.wait(i, timeout=30) for i in burst]
    refused = [e for e in envelopes if not e["ok"]]
    assert refused and all(e["error"]["code"] == "overloaded" for e in refused)
    assert all(e["error"]["retry_after_ms"] > 0 for e in refused)
    assert len(refused) < len(envelopes)  # the ones in time are served
    assert metric("redbatch_refused_total", model="echo", code="overloaded") - refused_before \
        == len(refused)


def test_without_a_target_batching_is_static(redis_url: str,
                                             worker_factory: Callable[..., Any]) -> None:
    client = Client(redis_url, "echo")
    with worker_factory(max_wait_ms=0) as worker:
        assert worker.batcher.targeted is None
        assert client.infer({"n": 1}, timeout=10) == {"n": 1}


def test_the_stats_line_shows_the_target(redis_url: str, r: redis.Redis,
                                         worker_factory: Callable[..., Any]) -> None:
    import json

    client = Client(redis_url, "echo")
    with worker_factory(latency_target_ms=250.0, maintenance_interval_s=0.1) as worker:
        client.infer({"n": 1}, timeout=10)
        time.sleep(0.5)
        announced = json.loads(r.hget("redbatch:workers:echo", worker.settings.consumer) or "{}")
    assert announced["latency"]["target_ms"] == 250.0
    assert {"observed_ms", "margin_ms", "percentile"} <= set(announced["latency"])




def test_stats_shows_the_target_the_observed_percentile_and_the_margin() -> None:
    from worker.commands.stats import describe_latency

    shown = describe_latency({"target_ms": 250.0, "observed_ms": 182.4, "percentile": 0.99,
                              "margin_ms": 10.0})
    assert shown == "p99 182 of 250 ms, margin 10 ms"
    assert describe_latency(None) == "—"
