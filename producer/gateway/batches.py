"""OpenAI's Batch API: POST/GET /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel. A batch is created `validating` in Redis; a runner (runner.py, in
every gateway and in `python -m producer batches`) takes it from there.

No 409 answers (the openai client retries them): a repeated create with the same
`Idempotency-Key` returns the first batch, whose id is derived from the key.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from producer.batches import keys, lines, objects
from producer.batches.store import BatchStore
from producer.gateway import errors, jsonio
from producer.gateway.errors import ApiError
from producer.gateway.files import file_of, page_of, page_query
from producer.gateway.jsonio import FastJSONResponse as JSONResponse

MAX_LIST = 100


def no_such_batch(batch_id: str) -> ApiError:
    return ApiError(404, f"No such Batch object: {batch_id}", "batch_not_found", "batch_id")


async def batch_of(store: BatchStore, batch_id: str, owner: str) -> dict[bytes, bytes]:
    meta = await store.batch_meta(batch_id) if batch_id.startswith("batch_") else {}
    if not meta or objects.text(meta, "owner") != owner:
        raise no_such_batch(batch_id)
    return meta


def checked_create(body: Any) -> tuple[str, str, str, int, dict[str, Any] | None]:
    """(input_file_id, endpoint, completion_window, its seconds, metadata), or 400."""
    if not isinstance(body, dict):
        raise errors.invalid("the body must be a JSON object")
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    if not isinstance(file_id, str) or not file_id:
        raise errors.invalid("'input_file_id' is required", "input_file_id")
    if endpoint not in lines.ENDPOINTS:
        raise errors.invalid(f"'endpoint' must be one of {sorted(lines.ENDPOINTS)}",
                             "endpoint")
    window = body.get("completion_window", "24h")
    seconds = objects.window_seconds(window)
    if seconds is None:
        raise errors.invalid("'completion_window' must be '24h' (or a shorter '<n>h', "
                             "'<n>m', '<n>s')", "completion_window")
    problem = objects.metadata_problem(body.get("metadata"))
    if problem:
        raise errors.invalid(problem, "metadata")
    return file_id, str(endpoint), str(window), seconds, body.get("metadata")


async def create_batch(request: Request) -> Response:
    gateway = request.app.state.gateway
    owner, store = gateway.owner(request), gateway.batches
    file_id, endpoint, window, seconds, metadata = checked_create(
        await gateway.json_body(request))
    source = await file_of(store, file_id, owner)
    if objects.text(source, "purpose") != "batch":
        raise errors.invalid(f"the file {file_id} is not a batch input file", "input_file_id")
    idempotency = request.headers.get("idempotency-key")
    batch_id = keys.batch_id_for(owner, idempotency) if idempotency else keys.new_batch_id()
    now_ms = int(time.time() * 1000)
    meta: dict[str, Any] = {
        "id": batch_id, "owner": owner, "endpoint": endpoint, "input_file_id": file_id,
        "completion_window": window, "status": objects.VALIDATING,
        "created_at": now_ms // 1000, "created_ms": now_ms,
        "expires_at": now_ms // 1000 + seconds, "total": 0, "completed": 0, "failed": 0,
        "metadata": "" if metadata is None else jsonio.dumps(metadata).decode()}
    if not await store.create(meta):
        return JSONResponse(objects.batch_object(await batch_of(store, batch_id, owner)))
    return JSONResponse(objects.batch_object(meta))


async def retrieve_batch(request: Request) -> Response:
    gateway = request.app.state.gateway
    meta = await batch_of(gateway.batches, request.path_params["batch_id"],
                          gateway.owner(request))
    return JSONResponse(objects.batch_object(meta))


async def cancel_batch(request: Request) -> Response:
    """`cancelling` now; the runner writes the lines not done as cancelled, then
    `cancelled`. A batch already final is returned as it is."""
    gateway = request.app.state.gateway
    batch_id, owner = request.path_params["batch_id"], gateway.owner(request)
    await batch_of(gateway.batches, batch_id, owner)
    await gateway.batches.cancel(batch_id, int(time.time()))
    return JSONResponse(objects.batch_object(await batch_of(gateway.batches, batch_id, owner)))


async def list_batches(request: Request) -> Response:
    gateway = request.app.state.gateway
    owner, store = gateway.owner(request), gateway.batches
    after, limit = page_query(request, MAX_LIST, 20)
    ids = await store.page(keys.batch_index(store.namespace, owner), after, limit)
    metas = await store.metas([store.keys(i).meta for i in ids])
    return JSONResponse(page_of([objects.batch_object(m) for m in metas if m], limit))
