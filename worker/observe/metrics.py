"""Prometheus metrics, served on /metrics (beside /healthz and /readyz) when `metrics_port` != 0.

Multiprocess-safe: under `--processes N` the supervisor sets PROMETHEUS_MULTIPROC_DIR, each
child writes its samples there, and gauges say how the children's values combine.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.exposition import ThreadingWSGIServer

from worker.observe.endpoints import start_server

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
CONTROLLED_LIMIT = Gauge("redbatch_controller_limit",
                         "A baseline batch_controller's current limit (issue 13)",
                         ["model", "limit"])  # limit: max_batch_size | max_wait_seconds
MERGE_TOKENS = Gauge("redbatch_merge_tokens",
                     "Padded tokens a merge of buckets into one batch may add", ["model"])
OOM_EVENTS = Counter("redbatch_oom_events", "Batches that ran out of memory", ["model", "bucket"])
OOM_SPLITS = Counter("redbatch_oom_splits", "Out-of-memory batches split in halves and retried",
                     ["model", "bucket"])
CUDA_GRAPH_BATCHES = Counter("redbatch_cuda_graph_batches",
                             "Forward passes where CUDA graphs were captured, by how each ran",
                             ["how"])  # how: replayed | eager

END_TO_END = Histogram("redbatch_request_seconds", "From XADD to the reply written (end to end)",
                       ["model"], buckets=LATENCY_BUCKETS)

# Sampled by worker.sampler, off the hot path. This process's own state sums across processes;
# the stream's state is the same for every process, so the most recent sample stands.
QUEUE_DEPTH = Gauge("redbatch_queue_depth", "Requests prepared and waiting for a batch",
                    ["model", "bucket"], multiprocess_mode="livesum")
IN_FLIGHT = Gauge("redbatch_inflight", "Entries read and not yet answered by this worker",
                  ["model"], multiprocess_mode="livesum")
STREAM_LENGTH = Gauge("redbatch_stream_length", "XLEN of the request stream", ["model"],
                      multiprocess_mode="livemostrecent")
GROUP_LAG = Gauge("redbatch_group_lag", "Entries not yet delivered to any worker of the group",
                  ["model"], multiprocess_mode="livemostrecent")
PENDING = Gauge("redbatch_pending_entries", "Entries delivered and not yet acknowledged",
                ["model"], multiprocess_mode="livemostrecent")
BACKLOG = Gauge("redbatch_backlog", "Requests not yet answered: group lag + pending",
                ["model"], multiprocess_mode="livemostrecent")
CONSUMERS = Gauge("redbatch_consumers", "Consumers registered in the group", ["model"],
                  multiprocess_mode="livemostrecent")
DEAD_LETTER_LENGTH = Gauge("redbatch_dead_letter_length", "Entries in the dead-letter stream",
                           ["model"], multiprocess_mode="livemostrecent")
THROUGHPUT = Gauge("redbatch_group_throughput", "Replies per second by the whole group, recently",
                   ["model"], multiprocess_mode="livemostrecent")
DRAIN_SECONDS = Gauge("redbatch_drain_seconds",
                      "Estimated time to answer the backlog at the recent rate (+Inf: stalled)",
                      ["model"], multiprocess_mode="livemostrecent")

# Incremented by the reclaimer and the dead-letter path.
RECLAIMED = Counter("redbatch_reclaimed_entries", "Entries claimed from idle consumers",
                    ["model"])
REDELIVERIES = Counter("redbatch_redeliveries", "Entries read that had been delivered before",
                       ["model"])
INTERNAL_KEY_ERRORS = Counter("redbatch_internal_key_errors",
                              "Writes to an internal key skipped: it holds another type",
                              ["model", "key"])
DEAD_LETTERS = Counter("redbatch_dead_letters", "Entries moved to the dead-letter stream",
                       ["model"])
REPLICATION_SHORT = Counter("redbatch_replication_short",
                            "Reply writes a WAIT reported short of replicas_to_wait", ["model"])


# The latency-target policy (policy/latency.py): why each batch left, and what it believed.
DISPATCHES = Counter("redbatch_dispatches", "Batches sent, by the reason they left",
                     ["model", "reason"])
DISPATCH_SLACK = Histogram("redbatch_dispatch_slack_seconds",
                           "Time in hand at dispatch: deadline less margin less predicted end",
                           ["model"], buckets=(-1, -.1, -.01, 0, .005, .01, .025, .05, .1, .25,
                                               .5, 1, 2.5))
REFUSED = Counter("redbatch_refused", "Requests answered at read time: predicted too late",
                  ["model", "code"])
LATENCY_TARGET = Gauge("redbatch_latency_target_seconds", "The end-to-end latency target",
                       ["model"], multiprocess_mode="max")
LATENCY_OBSERVED = Gauge("redbatch_latency_observed_seconds",
                         "End-to-end latency at the target percentile, recent window",
                         ["model"], multiprocess_mode="max")
BATCH_LINE_SHARE = Gauge("redbatch_batch_line_share",
                         "The share of the time batch jobs' lines may take beside online "
                         "requests, as the latency target steers it", ["model"],
                         multiprocess_mode="max")
LATENCY_MARGIN = Gauge("redbatch_latency_margin_seconds", "The safety margin below deadlines",
                       ["model"], multiprocess_mode="max")
SERVICE_COST = Gauge("redbatch_service_cost_seconds",
                     "Fitted batch cost per length bucket: fixed per batch, and per padded "
                     "token", ["model", "bucket", "term"], multiprocess_mode="max")
GENERATED_TOKENS = Counter("redbatch_generated_tokens", "Tokens sampled by generative models",
                           ["model"])
TIME_TO_FIRST_TOKEN = Histogram("redbatch_time_to_first_token_seconds",
                                "XADD to the first sampled token", ["model"],
                                buckets=LATENCY_BUCKETS)
DECODING_STEP_TIME = Histogram("redbatch_decoding_step_seconds", "One continuous-batching step",
                               ["model"], buckets=LATENCY_BUCKETS)
SEQUENCES = Gauge("redbatch_sequences", "Generation requests by state (running, waiting)",
                  ["model", "state"], multiprocess_mode="livesum")
PREEMPTIONS = Counter("redbatch_preemptions", "Sequences preempted (KV cache dropped)",
                      ["model"])
GENERATIONS_FINISHED = Counter("redbatch_generations_finished", "Generations ended, by reason",
                               ["model", "reason"])
PROMPT_TOKENS_SHARED = Counter("redbatch_prompt_tokens_shared", "Prompt tokens a choice took "
                               "from another choice's KV blocks instead of computing them")


def record_step(model: str, seconds: float, tokens: int, preempted: int, running: int,
                waiting: int) -> None:
    """One continuous-batching step of a generative model."""
    DECODING_STEP_TIME.labels(model).observe(seconds)
    GENERATED_TOKENS.labels(model).inc(tokens)
    PREEMPTIONS.labels(model).inc(preempted)
    SEQUENCES.labels(model, "running").set(running)
    SEQUENCES.labels(model, "waiting").set(waiting)


def observe_all(histogram: Any, values: Sequence[float]) -> None:
    """Observe many values of one labelled histogram at once, as observe() would each.

    Written by hand: prometheus-client has no bulk observe, and one observe() per request
    (two locked increments and a scan of the buckets) is a tenth of the echo worker's time
    per request. Falls back to observe() should the library's internals change.
    """
    bounds, buckets, total = (getattr(histogram, name, None)
                              for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    for index, count in Tally(bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)
    total.inc(sum(values))


def registry() -> CollectorRegistry:
    """The registry to expose: every process's samples under PROMETHEUS_MULTIPROC_DIR."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    combined = CollectorRegistry()
    multiprocess.MultiProcessCollector(combined)  # type: ignore[no-untyped-call]
    return combined


def serve(host: str, port: int,
          readiness: Callable[[], dict[str, bool]] | None = None) -> ThreadingWSGIServer | None:
    """Serve /metrics, /healthz and /readyz on a daemon thread (port 0: disabled)."""
    if not port:
        return None
    return start_server(host, port, registry(), readiness or (lambda: {}))
