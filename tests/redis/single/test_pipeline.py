"""Double buffering in the worker: batch N+1 is collated before batch N is postprocessed."""

from __future__ import annotations

from producer import Client
from tests.rigs.plugin_models import RecordingModel


def test_the_next_batch_is_staged_while_the_current_one_runs(redis_url: str,
                                                             worker_factory) -> None:
    client = Client(redis_url, "recordingmodel")
    ids = client.submit_many({"i": i} for i in range(12))  # three full batches, queued
    with worker_factory(model="tests.rigs.plugin_models:RecordingModel", bucket_boundaries=[64],
                        max_batch_size=4, max_wait_ms=1000, instances=1) as worker:
        envelopes = [client.wait(request_id, timeout=10) for request_id in ids]
    assert [e["result"] for e in envelopes] == [{"i": i} for i in range(12)]
    model = worker.model
    assert isinstance(model, RecordingModel)
    # The model instance is shared by the session's runs: this run's steps are the last six.
    assert model.steps[-6:] == [("collate", 0), ("collate", 4), ("postprocess", 0),
                                ("collate", 8), ("postprocess", 4), ("postprocess", 8)]
