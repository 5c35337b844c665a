"""Prometheus metrics, served on /metrics when `metrics_port` is not 0."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (.1, .2, .3, .4, .5, .6, .7, .8, .9, .95, 1.0)

REQUESTS = Counter("redbatch_requests", "Requests answered, by outcome",
                   ["model", "status"])
UNANSWERABLE = Counter("redbatch_unanswerable_entries",
                       "Entries acked without a reply (no usable id, or deleted)",
                       ["model", "reason"])
DROPPED_REPLIES = Counter("redbatch_dropped_replies",
                          "Results dropped because another consumer had claimed the entry",
                          ["model"])
BACKLOG = Gauge("redbatch_backlog", "Entries the group has not acked: pending + undelivered",
                ["model"], multiprocess_mode="mostrecent")
BATCH_SIZE = Histogram("redbatch_batch_size", "Requests per batch", ["model", "bucket"],
                       buckets=SIZE_BUCKETS)
PADDED_TOKENS = Histogram("redbatch_batch_padded_tokens", "n x longest per batch",
                          ["model", "bucket"], buckets=TOKEN_BUCKETS)
PADDING_EFFICIENCY = Histogram("redbatch_padding_efficiency",
                               "Real / padded tokens per batch", ["model"],
                               buckets=RATIO_BUCKETS)
REAL_TOKENS_TOTAL = Counter("redbatch_real_tokens", "Real tokens computed", ["model"])
PADDED_TOKENS_TOTAL = Counter("redbatch_padded_tokens", "Padded tokens computed", ["model"])
QUEUE_WAIT = Histogram("redbatch_queue_wait_seconds",
                       "From XADD to the start of the request's batch", ["model"],
                       buckets=LATENCY_BUCKETS)
COMPUTE_TIME = Histogram("redbatch_compute_seconds", "Collate + forward + postprocess per batch",
                         ["model"], buckets=LATENCY_BUCKETS)
BATCH_CAP = Gauge("redbatch_batch_cap", "The governor's current cap per bucket",
                  ["model", "bucket", "kind"])  # kind: requests | tokens
MEMORY_BYTES = Gauge("redbatch_memory_bytes", "Memory as the governor last read it",
                     ["model", "kind"])  # kind: used | limit | reserved | allocated
OOM_EVENTS = Counter("redbatch_oom_events", "Batches that ran out of memory", ["model", "bucket"])
OOM_SPLITS = Counter("redbatch_oom_splits", "Out-of-memory batches split in halves and retried",
                     ["model", "bucket"])


def serve(host: str, port: int) -> None:
    """Start the /metrics endpoint on a daemon thread (port 0: disabled)."""
    if port:
        start_http_server(port, addr=host)
