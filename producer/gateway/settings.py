"""Gateway settings: defaults < REDBATCH_* environment < flags, as for the worker."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from producer.local_redis import default_url
from producer.protocol import DEFAULT_GROUP, DEFAULT_NAMESPACE


class GatewaySettings(BaseSettings):
    """Everything a gateway process can be told; field names are the flag names."""

    # extra="ignore": the REDBATCH_* variables of the worker may be set in the same place
    model_config = SettingsConfigDict(env_prefix="REDBATCH_", extra="ignore")

    host: str = Field("127.0.0.1", description=(
        "address to listen on; a non-loopback one needs api_keys or allow_unauthenticated"))
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    redis_url: str = Field(default_factory=default_url, description=(
        "the Redis the workers serve; default: .redbatch/redis.url (a local worker's "
        "embedded Redis) if present, else redis://localhost:6379/0"))
    redis_password: SecretStr | None = Field(None, min_length=1, description=(
        "Redis AUTH password, in place of one in redis_url (no URL encoding)"))
    redis_cluster: bool = Field(False, description=(
        "redis_url is a seed node of a Redis Cluster (each model's queue sharded)"))
    namespace: str = Field(DEFAULT_NAMESPACE, min_length=1)
    group: str = Field(DEFAULT_GROUP, min_length=1)
    request_timeout_s: float = Field(30.0, gt=0, description=(
        "seconds an HTTP request waits for the workers; also each request's deadline_ms"))
    max_backlog: int | None = Field(None, gt=0, description=(
        "answer 429 instead of enqueueing past this many unacked requests per model"))
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "comma-separated bearer keys accepted; empty: no authentication"))
    max_body_bytes: int = Field(4 << 20, gt=0, description="larger request bodies get 413")
    max_inputs: int = Field(2048, gt=0, description="most inputs in one embeddings call")
    max_choices: int = Field(16, gt=0, le=128, description=(
        "most choices (n x prompts) in one chat or completions call"))
    live_worker_idle_s: float = Field(30.0, gt=0, description=(
        "a consumer seen within this many seconds counts as a live worker"))
    model_cache_s: float = Field(1.0, ge=0, description=(
        "how long a model's live-worker check is reused before Redis is asked again"))
    allow_unauthenticated: bool = Field(False, description=(
        "serve on a non-loopback address with no api_keys (logged as a warning)"))
    redis_pool_size: int = Field(300, gt=0, description=(
        "most Redis connections a gateway process holds (readiness probes use their own)"))
    redis_pool_timeout_s: float = Field(5.0, gt=0, description=(
        "how long a call waits for a free Redis connection before answering 503"))
    max_concurrent_requests: int = Field(256, gt=0, description=(
        "calls in flight per process (probes and /metrics not counted); more get 429"))
    max_header_bytes: int = Field(16 << 10, ge=1024, description=(
        "most bytes of a request's line and headers; more get 431 and the connection closes"))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "seconds to receive a request's whole header block, from its first byte or from the"
        " connection's start; then 408 and close"))
    body_timeout_s: float = Field(30.0, gt=0, description=(
        "seconds to receive a request's whole body once its headers are in; then 408 and"
        " close"))
    processes: int = Field(1, gt=0, description="gateway processes sharing the port")
    batch_runner: bool = Field(True, description=(
        "run batch jobs in this gateway (a lease per batch: any number of gateways may)"))
    batch_window: int = Field(256, gt=0, description="lines of one batch in flight at most")
    batch_max_backlog: int = Field(256, gt=0, description=(
        "admit batch lines only while the model's stream holds fewer unacked requests"))
    batch_busy_backlog: int = Field(2, gt=0, description=(
        "most batch lines queued while online requests are queued too"))
    batch_lease_s: float = Field(15.0, gt=0, description=(
        "a batch whose runner has not renewed its lease this long is taken over"))
    batch_flight_timeout_s: float = Field(900.0, gt=0, description=(
        "a batch line unanswered this long after it was admitted is admitted again"))
    batch_takeover_s: float = Field(30.0, gt=0, description=(
        "lines in flight when a batch is taken over are admitted again this soon, unless"
        " answered (the runner that died may have recorded lines it never queued)"))
    batch_max_lines: int = Field(50_000, gt=0, description="most lines of a batch's file")
    batch_max_file_bytes: int = Field(200 << 20, gt=0, description=(
        "largest file POST /v1/files takes"))
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        """A comma-separated string (env var or flag), or a list already."""
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value


class GatewaySettingsError(Exception):
    """A setting could not be loaded; the message is meant for the user as it is."""


def load_gateway_settings(**overrides: Any) -> GatewaySettings:
    """Settings from the environment, with `overrides` (the flags) on top; None = unset."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    try:
        return GatewaySettings(**flags)
    except ValidationError as exc:
        lines = [f"invalid setting '{'.'.join(map(str, e['loc']))}'{source(e['loc'], flags)}: "
                 f"{e['msg']}" + ("" if "redis" in str(e["loc"]) else f"; got {e.get('input')!r}")
                 for e in exc.errors()]  # no secret printed
        raise GatewaySettingsError("\n".join(lines)) from None


def source(loc: tuple[Any, ...], flags: dict[str, Any]) -> str:
    """" from --port (flag)" or " from REDBATCH_PORT (environment)": where to change it."""
    if len(loc) != 1:
        return ""
    name = str(loc[0])
    if name in flags:
        return f" from --{name.replace('_', '-')} (flag)"
    return f" from REDBATCH_{name.upper()} (environment)"
