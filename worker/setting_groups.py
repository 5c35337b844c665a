"""The worker's settings in groups, for `--help` (worker/cli_flags.py): one mapping, next to
the settings, that a test holds to cover every setting exactly once."""

from __future__ import annotations

# (group, what it is about, its settings), in the order --help shows them.
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("connection", "the Redis to serve and the keys in it", (
        "redis_url", "redis_password", "namespace", "group", "consumer", "data_dir",
        "result_ttl_ms", "max_payload_bytes", "reply_prefixes", "block_ms",
        "maintenance_interval_s", "shutdown_grace_s")),
    ("cluster", "Redis Cluster, replicas, and the workers sharing a queue", (
        "redis_cluster", "shards", "replicas_to_wait", "replicas_wait_ms", "claim_idle_ms",
        "max_deliveries", "consumer_idle_ms", "processes", "devices")),
    ("model", "what is served, where and how", (
        "model", "model_name", "model_options", "device", "dtype", "torch_threads",
        "instances", "cpu_cores", "warmup", "cuda_graphs", "cache_dir")),
    ("batching", "how requests are grouped into batches", (
        "max_batch_size", "max_batch_tokens", "max_wait_ms", "bucket_boundaries",
        "merge_tokens", "background_rows", "background_share", "background_quiet_ms",
        "max_inflight", "read_count", "calibration_dir")),
    ("latency", "an end-to-end latency target, or a baseline controller", (
        "latency_target_ms", "latency_percentile", "shed_over_target", "batch_controller",
        "controller_target_ms")),
    ("memory", "the memory governor: batch caps under a memory limit", (
        "memory_limit_bytes", "memory_high_watermark", "memory_low_watermark",
        "governor_grow_after_s", "governor_cut_after_s", "governor_forgive_after_s")),
    ("observability", "logs and metrics", (
        "metrics_port", "metrics_host", "log_level", "log_format", "log_interval_s")),
)
GROUP_NAMES = tuple(name for name, _, _ in GROUPS)
