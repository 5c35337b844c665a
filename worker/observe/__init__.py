"""Observability: Prometheus metrics, the sampler that refreshes the gauges read from
Redis, the /metrics /healthz /readyz endpoints, what ready means, and logging."""
