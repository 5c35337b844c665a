"""POST /rerank, /v1/rerank and /v2/rerank: a reranker (cross-encoder) model through Redis.

The body (rerank_shapes.py, TEI's or Cohere's) names the model, or leaves it to the one live
reranker (TEI's shape has no `model`). Each document goes to the workers as one request, so
that each (query, document) pair is bucketed by its own tokenised length, the way each input
of /v1/embeddings is: the dispatcher sends them in one pipeline and waits on one reply list.
"""

from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from producer.gateway import errors, metrics
from producer.gateway.discovery import Discovery
from producer.gateway.dispatch import Dispatcher
from producer.gateway.errors import ApiError
from producer.gateway.jsonio import FastJSONResponse as JSONResponse
from producer.gateway.rerank_shapes import parse_rerank_request, rerank_response, worker_payloads
from producer.gateway.settings import GatewaySettings
from producer.liveness import Kind


class Gateway(Protocol):
    """What the route needs of the app's gateway (app.py), which imports this module."""

    settings: GatewaySettings
    dispatcher: Dispatcher
    discovery: Discovery

    def authorize(self, request: Request) -> None: ...

    async def json_body(self, request: Request) -> Any: ...

    async def require_live(self, model: str, kind: Kind) -> None: ...


async def rerank(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.authorize(request)
    parsed = parse_rerank_request(await gateway.json_body(request), gateway.settings.max_inputs)
    model = parsed.model or await only_reranker(gateway)
    await gateway.require_live(model, Kind.RERANKER)
    metrics.INPUTS.labels(model).inc(len(parsed.texts))
    envelopes = await gateway.dispatcher.run(model, worker_payloads(parsed))
    for envelope in envelopes:
        if not envelope.get("ok"):
            raise errors.from_worker(envelope.get("error"))
    return JSONResponse(rerank_response(parsed, [envelope["result"] for envelope in envelopes]))


async def only_reranker(gateway: Gateway) -> str:
    """The model of a body that names none: the one reranker with a live worker."""
    found = [listed.name for listed in await gateway.discovery.live_models()
             if listed.kind is Kind.RERANKER]
    if len(found) != 1:
        live = f"the live rerankers are {found}" if found else "no reranker has a live worker"
        raise ApiError(400 if found else 404, f"'model' is required: {live}",
                       "model_not_found" if not found else "invalid_request", "model")
    return found[0]
