"""Worker settings: defaults < TOML file (--config) < REDBATCH_* environment < flags."""

from __future__ import annotations

import json
import os
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from producer.protocol import DEFAULT_GROUP, DEFAULT_NAMESPACE
from worker.policy.device_defaults import UNSET_STAYS_UNSET
from worker.setting_sources import SettingSources, WholeEnv, WholeToml, describe_validation_error


def default_consumer_name() -> str:
    """Stable and unique per process: host plus pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    """Everything a worker can be told. Field names are the TOML keys and flag names."""

    model_config = SettingsConfigDict(env_prefix="REDBATCH_", extra="forbid")

    redis_url: str | None = Field(None, description=(
        "Redis to serve: redis://, rediss:// (TLS), redis+sentinel://host:port[,...]/service"
        "[/db] or rediss+sentinel://; none: the embedded Redis of a worker running in this "
        "directory (<data_dir>/redis.url), else a new embedded one"))
    redis_cluster: bool = Field(False, description="redis_url is a seed node of a Redis Cluster")
    redis_password: SecretStr | None = Field(None, min_length=1, description=(
        "Redis AUTH password, in place of one in redis_url: any characters, no URL "
        "encoding; kept out of logs and of child processes' command lines"))
    shards: int = Field(0, ge=0, description=(
        "Redis Cluster: streams per model; 0: the count published at <namespace>:shards:"
        "<model>, else 2 x the masters. A larger count than the published one raises it"))
    replicas_to_wait: int = Field(-1, ge=-1, description=(
        "WAIT for this many replicas after each reply + ack; -1: 1 while the master has a "
        "connected replica, else 0; 0 disables"))
    replicas_wait_ms: int = Field(100, gt=0, description="WAIT timeout after each write")
    namespace: str = Field(DEFAULT_NAMESPACE, min_length=1, description="every key's prefix")
    group: str = Field(DEFAULT_GROUP, min_length=1,
                       description="the consumer group a model's workers share")
    consumer: str = Field(default_factory=default_consumer_name, min_length=1,
                          description="this worker's name in the group, one per process")

    model: str = Field("minilm", description="built-in name or 'package.module:ClassName'")
    model_name: str = Field("", description="the name in the stream key; none: the model's "
                            "(minilm; pkg.mod:MyModel: mymodel)")
    model_options: dict[str, Any] = Field(default_factory=dict, description="model options (JSON)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16", "int8"] = Field("auto", description=(
        "the dtype the model computes in; auto: bfloat16 on CUDA >= 8.0, float16 on older "
        "CUDA; on a CPU bfloat16 with AMX or AVX-512 BF16 (generative models: float32), else "
        "float32. float32 on CUDA >= 8.0 allows TF32 matmuls. int8: CPU encoder kinds only"))
    cuda_graphs: bool = Field(True, description="capture CUDA graphs at warm-up for fixed "
                              "shapes, others run eagerly; ignored with one log line on a CPU")
    torch_threads: int = Field(0, ge=0, description="torch intra-op CPU threads; 0: the "
                               "cores shared out among the processes and instances")
    instances: int | Literal["auto"] = Field("auto", description=(
        "model instances in each process: batches computed at once from one queue, sharing one "
        "copy of the weights (Triton's instance_group count). auto, for a model that declares "
        "concurrent_forward (the built-ins do): one single-threaded instance per CPU core, two "
        "per CUDA device; else one"))
    cpu_cores: int = Field(0, ge=0, description="cores this process may use; 0: read from its "
                           "CPU affinity and cgroup quota (--processes gives each its share)")

    max_batch_size: int = Field(32, gt=0, description="most requests in one batch; on CUDA 512 "
                                "unless set")
    max_batch_tokens: int = Field(8192, gt=0, description="cap on n x longest per batch; on "
                                  "CUDA 65536 unless set")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a batch may wait to fill "
                               "(static batching: unused when latency_target_ms is set)")
    latency_target_ms: float | None = Field(None, gt=0, description=(
        "end-to-end target from XADD to reply, at latency_percentile: batches leave as late "
        "as the target allows and only while waiting raises throughput; none: static batching"))
    latency_percentile: float = Field(0.99, gt=0, lt=1, description="the percentile the "
                                      "target holds (0.99: p99)")
    shed_over_target: bool = Field(False, description="refuse at read time, with `overloaded` "
                                   "and retry_after_ms, a request predicted to miss the target")
    batch_controller: Literal["static", "aimd", "step", "dynamic_timeout", "cork"] = Field(
        "static", description=(
            "a BASELINE for comparison, not a recommended mode (policy/controllers.py, "
            "policy/cork.py): aimd (Clipper: batch cap +2 while the batch p99 is under "
            "controller_target_ms, x0.9 over), step (cap +-2 on the end-to-end p99 against "
            "0.7 and 1.2 x the target), dynamic_timeout (wait max(10 ms, 2 x mean latency)) "
            "or cork (BentoML's CorkDispatcher: one FIFO queue, latency = a*n + b fitted over "
            "50 batches, waits while that pays, refuses at dispatch with `overloaded` the "
            "oldest predicted past controller_target_ms); static: max_wait_ms and "
            "max_batch_size as set. Not with latency_target_ms"))
    controller_target_ms: float | None = Field(None, gt=0, description=(
        "the target of batch_controller aimd, step or cork (ms); latency_target_ms is "
        "redbatch's own"))
    bucket_boundaries: list[int] | None = Field(None, description="None: the model's (CUDA: "
                                                "thinned to 1.5x steps)")
    merge_tokens: int | None = Field(None, ge=0, description=(
        "an unfilled batch absorbs another bucket when that adds at most this many padded "
        "tokens (the model's fixed cost per batch over its cost per padded token); none: "
        "measured at warm-up; 0 keeps buckets apart"))
    # CPU, online p99 beside a batch (docs/gateway.md; CUDA: policy/device_defaults.py): 2 rows
    # x1.04-1.10, 4 x1.10-1.24, uncapped x1.61; share 0.1 x1.04-1.24, 0.15 x1.07-1.18, 0.25 x1.3
    background_rows: int = Field(2, ge=0, description=(
        "most priority < 0 requests (batch jobs' lines) in a batch while online ones came "
        "within background_quiet_ms (CUDA: 4 unless set); 0: no cap"))
    background_share: float = Field(0.1, gt=0, le=1, description=(
        "the most of the time batches of priority < 0 requests alone take meanwhile "
        "(CUDA: 0.25 unless set); with latency_target_ms, the least (it grows within it)"))
    background_quiet_ms: int = Field(1000, ge=0, description="online quiet this long: no cap")
    max_inflight: int = Field(512, gt=0, description="entries read, not yet answered; on "
                              "CUDA 4096 unless set")
    read_count: int = Field(256, gt=0, description="most entries per XREADGROUP")
    block_ms: int = Field(1000, gt=0, description="XREADGROUP BLOCK; never 0")

    memory_limit_bytes: int | None = Field(
        None, gt=0, description="memory the governor keeps under; none: device, cgroup or RAM")
    memory_high_watermark: float = Field(0.90, gt=0, le=1, description="cut batch caps above")
    memory_low_watermark: float = Field(0.75, gt=0, le=1, description="grow batch caps below")
    governor_grow_after_s: float = Field(5.0, ge=0, description="calm time per growth step")
    governor_cut_after_s: float = Field(1.0, ge=0, description="time between two cuts")
    governor_forgive_after_s: float = Field(
        300.0, ge=0, description="calm time before an out-of-memory size is tried again")
    warmup: bool = Field(True, description="run each bucket shape once before serving, and "
                         "measure merge_tokens")
    calibration_dir: Path = Field(Path("configs/calibration"),
                                  description="where `calibrate` writes and `run` reads")

    result_ttl_ms: int = Field(3_600_000, gt=0, description="how long a reply is kept")

    claim_idle_ms: int = Field(30_000, gt=0, description="claim others' entries idle this long")
    max_deliveries: int = Field(5, gt=0, description="deliveries before an entry is dead-lettered")
    consumer_idle_ms: int = Field(3_600_000, gt=0,
                                  description="remove consumers idle this long, holding nothing")
    maintenance_interval_s: float = Field(5.0, gt=0, description="trim, backlog gauge, cleanup")
    shutdown_grace_s: float = Field(30.0, ge=0, description="time to answer what is held on stop")
    processes: int = Field(1, gt=0, description="worker processes to run and supervise")
    devices: str = Field("", description="comma-separated, e.g. cuda:0,cuda:1: a process each")
    max_payload_bytes: int = Field(1 << 20, gt=0, description="larger requests are refused")
    reply_prefixes: list[str] = Field(default_factory=list, description=(
        "key prefixes a request's reply_to may name besides <namespace>:reply: (list "
        "replies) and <namespace>:stream: (streamed ones); none by default"))

    metrics_port: int = Field(9100, ge=0, le=65535, description="0 disables /metrics")
    metrics_host: str = Field("0.0.0.0", description="where /metrics and /healthz listen")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$",
                           description="debug, info, warning or error")
    log_format: str = Field("auto", pattern="^(auto|json|console)$", description=(
        "json, console, or auto: console on a terminal, else json"))
    log_interval_s: float = Field(60.0, ge=0, description="a progress line this often; 0: none")
    data_dir: Path = Field(Path(".redbatch"), description="embedded Redis data")
    cache_dir: Path | None = Field(None, description=(
        "where a model keeps what it derives from its weights between starts (a GGUF "
        "file's dequantised tensors); none: $XDG_CACHE_HOME/redbatch or ~/.cache/redbatch"))

    @field_validator("instances", mode="before")
    @classmethod
    def _instances_count_or_auto(cls, value: Any) -> int | str:
        """One clear message for both forms (a union would report one error per member)."""
        if value == "auto":
            return value
        try:
            count = int(value)
        except (TypeError, ValueError):
            count = 0
        if count <= 0 or isinstance(value, bool | float):
            raise ValueError('must be "auto" or a whole number above 0')
        return count

    @field_validator("bucket_boundaries")
    @classmethod
    def _boundaries_increase(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(b <= a for a, b in zip([0, *value], value, strict=False)):
            raise ValueError("must be positive and strictly increasing, e.g. [16, 32, 64]")
        return value

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> Settings:
        if self.memory_low_watermark >= self.memory_high_watermark:
            raise ValueError("memory_low_watermark must be below memory_high_watermark")
        return self

    @model_validator(mode="after")
    def _one_batching_policy(self) -> Settings:
        """A baseline controller replaces redbatch's targeted dispatch; aimd, step and cork
        need a target of their own, the others none."""
        kind = self.batch_controller
        needs_target = kind in ("aimd", "step", "cork")
        if kind != "static" and self.latency_target_ms is not None:
            raise ValueError(f"batch_controller {kind!r} is a baseline that replaces "
                             "latency_target_ms: set one of the two")
        if needs_target and self.controller_target_ms is None:
            raise ValueError(f"batch_controller {kind!r} needs controller_target_ms")
        if not needs_target and self.controller_target_ms is not None:
            raise ValueError(f"controller_target_ms is for batch_controller aimd or step, "
                             f"or cork, not {kind!r}")
        return self

    @model_validator(mode="after")
    def _reply_prefixes_outside_internal_keys(self) -> Settings:
        """A prefix that covers the worker's own keys would let a producer write them."""
        ns = f"{self.namespace}:"
        for prefix in self.reply_prefixes:
            covers_internal = ns.startswith(prefix) or (
                prefix.startswith(ns) and not prefix.startswith((f"{ns}reply:", f"{ns}stream:")))
            if not prefix or covers_internal:
                raise ValueError(f"reply_prefixes: {prefix!r} would cover redbatch's own keys "
                                 f"(under {ns!r}); name a prefix of your application's")
        return self

    @model_validator(mode="after")
    def _password_needs_a_url(self) -> Settings:
        if self.redis_password is not None and not self.redis_url:
            raise ValueError("redis_password needs redis_url: the embedded Redis has none")
        return self

    _sources: SettingSources | None = PrivateAttr(None)

    def where(self, name: str) -> str:
        """Where setting `name` came from, for a message: "--max-batch-size (flag)"."""
        return self._sources.where(name) if self._sources else name

    @property
    def sources(self) -> SettingSources:
        return self._sources or SettingSources(list(type(self).model_fields))

    @property
    def redis_secret(self) -> str | None:
        """redis_password revealed, for the client (producer/connection.py)."""
        return None if self.redis_password is None else self.redis_password.get_secret_value()

    @model_validator(mode="after")
    def _derive_model_name(self) -> Settings:
        if not self.model_name:
            self.model_name = self.model.rpartition(":")[2].lower()
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, WholeEnv(settings_cls), WholeToml(settings_cls))


def exported(settings: Settings) -> dict[str, str]:
    """Each set setting as text a flag or REDBATCH_* variable takes, secrets revealed: what
    a child process is handed (secrets by environment only: a command line is public). An
    unset setting the child resolves for itself (device_defaults.py) is left out."""
    texts, unset = {}, set(UNSET_STAYS_UNSET) - settings.model_fields_set
    for name, value in settings.model_dump(mode="json", exclude=unset).items():
        if name == "redis_password" and settings.redis_password is not None:
            value = settings.redis_password.get_secret_value()
        if value is not None:
            texts[name] = value if isinstance(value, str) else json.dumps(value)
    return texts


class SettingsError(Exception):
    """A setting could not be loaded; the message is meant for the user as it is."""


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """Build settings from the layers; `overrides` are the command-line flags. The settings
    remember where each came from (Settings.where)."""
    if config is not None and not config.is_file():
        raise SettingsError(f"config file not found: {config}")
    file_keys: list[str] = []
    if config is not None:
        try:
            file_keys = list(tomllib.loads(config.read_text()))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SettingsError(f"config file {config} is not valid TOML: {exc}") from None

    class FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=config)

    flags = {k: v for k, v in overrides.items() if v is not None}
    sources = SettingSources.find(list(Settings.model_fields), flags, config, file_keys)
    try:
        settings = FromFile(**flags)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc.errors(), sources)) from None
    except ValueError as exc:  # a malformed TOML file or JSON environment value
        raise SettingsError(f"could not read settings: {exc}") from None
    settings._sources = sources
    return settings
