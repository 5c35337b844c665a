"""End to end through Redis: a model that runs out of memory over N padded tokens.

Every request is answered correctly (OOM batches are split, only an input too large alone
fails), the bucket's caps drop to N or below, and they grow back once the pressure is gone.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import redis
import torch
from prometheus_client import REGISTRY

from producer import Client
from tests.rigs.plugin_models import PressureModel
from worker.pipeline.worker import Worker

N = 100  # padded tokens a batch may hold while under pressure
PAYLOAD_BYTES = 30  # the echo length of each small payload (msgpack)


def payload(i: int, pad: int = 17) -> dict[str, object]:
    return {"i": i, "pad": "x" * pad}


def sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, f"metric {name}{labels} not exported"
    return value


def collect(client: Client, ids: list[str]) -> list[dict]:
    return [client.wait(request_id, timeout=30) for request_id in ids]


@pytest.mark.parametrize("instances", [1, 2])  # two: the instances share the one governor
def test_oom_batches_split_caps_drop_and_recover(redis_url: str, r: redis.Redis,
                                                 worker_factory, instances: int) -> None:
    client = Client(redis_url, "pressuremodel")
    ids = client.submit_many(payload(i) for i in range(48))  # queued before the worker starts
    too_large = client.submit(payload(-1, pad=200))
    settings = dict(model="tests.rigs.plugin_models:PressureModel",
                    model_options={"max_padded_tokens": N}, bucket_boundaries=[64],
                    max_batch_size=16, max_batch_tokens=480, max_wait_ms=20,
                    memory_limit_bytes=1 << 40, governor_grow_after_s=60, instances=instances)
    model = PressureModel(max_padded_tokens=N)  # its own: the requests are already queued
    model.load(torch.device("cpu"))
    with worker_factory(instance=model, **settings) as worker:
        worker: Worker
        try:
            envelopes = collect(client, ids)
            assert [e["result"] for e in envelopes] == [payload(i) for i in range(48)]
            refused = client.wait(too_large, timeout=30)
            assert refused["ok"] is False and refused["error"]["code"] == "too_large"

            governor = worker.governor
            splits = sum(runner.splits for runner in worker.runners)
            oom_events = sum(runner.oom_events for runner in worker.runners)
            under_pressure = governor.caps[0]
            print(f"\nunder pressure: {len(ids) + 1} requests, {oom_events} OOM events, "
                  f"{splits} splits, caps {governor.base[0]} -> {under_pressure}")
            assert splits >= 3 and under_pressure.tokens <= N
            assert max(model.batch_tokens) <= N
            labels = {"model": "pressuremodel", "bucket": "0"}
            assert sample("redbatch_oom_splits_total", labels) >= splits
            assert sample("redbatch_batch_cap", {**labels, "kind": "tokens"}) == \
                under_pressure.tokens

            model.max_padded_tokens = None  # the pressure is gone; be quick to notice it
            governor.policy = replace(governor.policy, grow_after_s=0.05, forgive_after_s=0.3)
            deadline = time.monotonic() + 30
            while governor.caps[0] != governor.base[0] and time.monotonic() < deadline:
                wave = client.submit_many(payload(i) for i in range(16))
                assert all(e["ok"] for e in collect(client, wave))
                time.sleep(0.06)
            print(f"recovered: caps {governor.caps[0]}")
            assert governor.caps[0] == governor.base[0]
            wave = client.submit_many(payload(i) for i in range(16))
            assert max(e["meta"]["batch_size"] for e in collect(client, wave)) > N // 30
        finally:
            model.max_padded_tokens = N
