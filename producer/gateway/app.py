"""The routes: POST /v1/embeddings, /v1/chat/completions and /v1/completions (generation.py),
/v1/rerank (rerank.py), the Files and Batch APIs (files.py, batches.py), GET /v1/models,
/metrics, /healthz (alias /health) and /readyz. The lifespan runs a batch runner
(producer/batches/runner.py) unless `batch_runner` is off.

`create_app(settings)` is the composition root: one Redis client per process (built by
`producer.connection.async_client`, so `redis_url` takes the same forms as everywhere else:
redis://, rediss://, unix://, Sentinel), whose bounded, blocking connection pool the
Dispatcher and the Discovery share (pools.py), a one-connection client of its own for
readiness, the in-flight cap (limits.py), and handlers that turn every failure into OpenAI's
error shape. A Redis failure reaches the caller as one fixed message; its details (hosts,
ports, Redis's own error text) go to the log only.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Any

import structlog
from redis.exceptions import RedisClusterException, RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from producer.batches import keys as batch_keys
from producer.batches.keys import holder_name
from producer.batches.runner import Runner, RunnerConfig
from producer.batches.store import BatchStore
from producer.gateway import batches, errors, events, files, metrics, pools
from producer.gateway.choices import chat_completions, completions
from producer.gateway.discovery import Discovery, ModelState
from producer.gateway.dispatch import Dispatcher
from producer.gateway.errors import ApiError
from producer.gateway.generation import Generations
from producer.gateway.jsonio import FastJSONResponse as JSONResponse
from producer.gateway.jsonio import JSONDecodeError, loads
from producer.gateway.limits import HttpLimits, InFlightLimit
from producer.gateway.openai_shapes import (
    check_dimensions,
    embedding_of,
    embeddings_response,
    model_object,
    models_response,
    parse_embedding_request,
)
from producer.gateway.rerank import rerank
from producer.gateway.settings import GatewaySettings, load_gateway_settings
from producer.liveness import Kind

log = structlog.get_logger("redbatch.gateway")


class Gateway:
    """The state one process's handlers share."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.redis = pools.shared_client(settings)
        self.probe = pools.probe_client(settings)  # readiness, apart from the shared pool
        self.health = events.RedisHealth(self.probe, settings.redis_url)
        self.dispatcher = Dispatcher(self.redis, settings.namespace, settings.group,
                                     settings.max_backlog, settings.request_timeout_s)
        self.discovery = Discovery(self.redis, settings.namespace, settings.group,
                                   settings.live_worker_idle_s, settings.model_cache_s)
        self.generations = Generations(self.redis, self.dispatcher, settings.namespace,
                                       settings.request_timeout_s)
        self.batches = BatchStore(self.redis, settings.namespace)

    def authorize(self, request: Request) -> str | None:
        """401 unless a configured key is presented as `Authorization: Bearer <key>`; the
        key (None when no keys are configured)."""
        keys = self.settings.api_keys
        if not keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(
                hmac.compare_digest(key.strip().encode(), k.encode()) for k in keys):
            raise ApiError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                           "invalid_api_key", None, {"WWW-Authenticate": "Bearer"})
        return key.strip()

    def owner(self, request: Request) -> str:
        """Whose files and batches the caller sees (authorized first)."""
        return batch_keys.owner_of(self.authorize(request))

    def runner(self) -> Runner:
        s = self.settings
        config = RunnerConfig(s.batch_window, s.batch_max_backlog, s.batch_busy_backlog,
                              s.batch_lease_s, s.batch_flight_timeout_s, s.batch_takeover_s,
                              max_lines=s.batch_max_lines,
                              max_line_bytes=s.max_body_bytes, max_inputs=s.max_inputs)
        return Runner(self.batches, self.dispatcher.client, self.kind_of, config,
                      holder_name("gateway"))

    async def kind_of(self, model: str) -> tuple[bool, Kind | None]:
        info = await self.discovery.info(model)
        return info.state is not ModelState.UNKNOWN, info.kind

    async def json_body(self, request: Request) -> Any:
        """The body as JSON: 415 for another content type, 413 past the limit, 400 if bad."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got "
                           f"{content_type or 'none'!r}", "unsupported_media_type")
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise body_too_large(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise body_too_large(limit)
        try:
            return loads(body)
        except (JSONDecodeError, RecursionError) as exc:
            raise errors.invalid(f"the body is not valid JSON: {exc}", None,
                                 "invalid_json") from None

    async def require_live(self, model: str, kind: Kind) -> None:
        """404, 503, or 400 when the model's workers announced another kind than the
        route's (an embedding route on a generative model or a reranker...)."""
        info = await self.discovery.info(model)
        if info.state is ModelState.UNKNOWN:
            raise errors.unknown_model(model)
        if info.state is ModelState.NO_WORKER:
            raise errors.no_live_worker(model)
        if info.kind is not None and info.kind is not kind:
            raise errors.wrong_model_kind(model, info.kind)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "body_too_large")


async def embeddings(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    parsed = parse_embedding_request(await gateway.json_body(request),
                                     gateway.settings.max_inputs)
    await gateway.require_live(parsed.model, Kind.EMBEDDING)
    metrics.INPUTS.labels(parsed.model).inc(len(parsed.inputs))
    envelopes = await gateway.dispatcher.run(parsed.model, [{"text": t} for t in parsed.inputs])
    for envelope in envelopes:
        if not envelope.get("ok"):
            raise errors.from_worker(envelope.get("error"))
    results = [envelope["result"] for envelope in envelopes]
    check_dimensions(parsed, len(embedding_of(results[0])))
    return JSONResponse(embeddings_response(parsed, results))


async def list_models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    return JSONResponse(models_response(await gateway.discovery.live_models()))


async def retrieve_model(request: Request) -> Response:
    """One model of the list, or 404 (OpenAI's `models.retrieve`)."""
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    name = request.path_params["model"]
    for listed in await gateway.discovery.live_models():
        if listed.name == name:
            return JSONResponse(model_object(*listed))
    raise errors.unknown_model(name)


async def metrics_endpoint(request: Request) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def readyz(request: Request) -> Response:
    """Ready when Redis answers PING; 503 otherwise, so a balancer routes elsewhere."""
    try:
        await request.app.state.gateway.probe.ping()
    except (RedisError, RedisClusterException, OSError) as exc:
        log_redis_failure(request, exc)
        return JSONResponse({"ok": False, "error": errors.QUEUE_UNAVAILABLE}, status_code=503)
    return JSONResponse({"ok": True})


def log_redis_failure(request: Request, exc: Exception) -> None:
    """The details of a Redis failure, for the operator only (callers get a fixed text);
    logged once per outage (events.RedisHealth)."""
    request.app.state.gateway.health.failed(request.url.path, exc)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return await api_error(request, ApiError(exc.status_code, message, code))


async def redis_error(request: Request, exc: Exception) -> Response:
    """503 with a fixed message: Redis's text names hosts, ports and key types."""
    log_redis_failure(request, exc)
    return await api_error(request, errors.queue_unavailable())


async def server_error(request: Request, exc: Exception) -> Response:
    return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}",
                                             "internal_error"))


ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),  # TEI's path
    Route("/v1/rerank", rerank, methods=["POST"]),  # Cohere's v1, Jina's, vLLM's
    Route("/v2/rerank", rerank, methods=["POST"]),  # Cohere's v2
    Route("/v1/files", files.create_file, methods=["POST"]),
    Route("/v1/files", files.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", files.retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
    Route("/v1/batches", batches.create_batch, methods=["POST"]),
    Route("/v1/batches", batches.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batches.retrieve_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/health", healthz, methods=["GET"]),  # TEI's and vLLM's name for it
    Route("/readyz", readyz, methods=["GET"]),
]


def create_app(settings: GatewaySettings | None = None) -> Any:
    """The ASGI app (Starlette inside the metrics middleware)."""
    settings = settings or load_gateway_settings()
    gateway = Gateway(settings)
    events.log_start(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        stop = asyncio.Event()
        running = asyncio.create_task(gateway.runner().run(stop)) \
            if settings.batch_runner else None
        yield
        stop.set()
        if running is not None:
            await running
        gateway.health.close()
        await gateway.redis.aclose()
        await gateway.probe.aclose()

    app = Starlette(routes=ROUTES, exception_handlers={
        ApiError: api_error, HTTPException: http_error, RedisError: redis_error,
        RedisClusterException: redis_error, Exception: server_error},
        middleware=[Middleware(events.AccessLog)], lifespan=lifespan)
    app.state.gateway = gateway
    limits = HttpLimits(settings.max_header_bytes, settings.header_timeout_s,
                        settings.body_timeout_s)
    return metrics.MetricsMiddleware(InFlightLimit(app, settings.max_concurrent_requests,
                                                   limits))
