"""OpenAI's Files API for batch input and output: POST/GET /v1/files, GET/DELETE
/v1/files/{id}, GET /v1/files/{id}/content. The files live in Redis (producer/batches).

An upload is streamed: python-multipart (through Starlette's form parser) spools the part to
a temporary file past 1 MB, and its lines go into Redis a window at a time, so a 200 MB file
never sits in memory. A file is listed and readable only once all its lines are in.
A caller sees only its own files (the owner is a digest of its API key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from producer.batches import keys, objects, upload
from producer.batches.store import READ_WINDOW, BatchStore
from producer.gateway import errors
from producer.gateway.errors import ApiError
from producer.gateway.jsonio import FastJSONResponse as JSONResponse

CHUNK_BYTES = 1 << 20
MAX_LIST = 10_000  # OpenAI's most files a page


def no_such_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "file_not_found", "file_id")


async def file_of(store: BatchStore, file_id: str, owner: str) -> dict[bytes, bytes]:
    """The file's stored object, or 404 (for another caller's file too)."""
    meta = await store.file_meta(file_id) if keys.is_file_id(file_id) else {}
    if not meta or objects.text(meta, "owner") != owner:
        raise no_such_file(file_id)
    return meta


async def create_file(request: Request) -> Response:
    gateway = request.app.state.gateway
    owner, limit = gateway.owner(request), gateway.settings.batch_max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + CHUNK_BYTES:  # the form's own bytes
        raise too_large(limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(415, "POST /v1/files takes multipart/form-data with 'file' and "
                       "'purpose'", "unsupported_media_type")
    async with request.form() as form:
        found, purpose = form.get("file"), form.get("purpose")
        if purpose != "batch":
            raise errors.invalid("'purpose' must be 'batch' (the only files this server "
                                 "keeps)", "purpose")
        if not isinstance(found, UploadFile):
            raise errors.invalid("'file' must be a file part", "file")
        try:
            meta = await upload.upload(gateway.batches, parts(found),
                                       found.filename or "input.jsonl", owner, limit,
                                       gateway.settings.max_body_bytes)
        except upload.FileTooLarge:
            raise too_large(limit) from None
    return JSONResponse(objects.file_object(meta))


async def parts(found: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await found.read(CHUNK_BYTES):
        yield chunk


def too_large(limit: int) -> ApiError:
    return ApiError(400, f"the file is larger than {limit} bytes (batch_max_file_bytes)",
                    "file_too_large", "file")


def page_query(request: Request, most: int, default: int) -> tuple[str | None, int]:
    """OpenAI's `after` cursor and `limit`, checked."""
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise errors.invalid(f"'limit' must be an integer from 1 to {most}", "limit")
    return request.query_params.get("after"), int(raw)


def page_of(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


async def list_files(request: Request) -> Response:
    gateway = request.app.state.gateway
    owner = gateway.owner(request)
    after, limit = page_query(request, MAX_LIST, MAX_LIST)
    purpose = request.query_params.get("purpose")
    store: BatchStore = gateway.batches
    ids = await store.page(keys.file_index(store.namespace, owner), after, limit)
    metas = await store.metas([keys.file_keys(store.namespace, i)[0] for i in ids])
    found = [objects.file_object(m) for m in metas if m]
    if purpose is not None:
        found = [f for f in found if f["purpose"] == purpose]
    return JSONResponse(page_of(found, limit))


async def retrieve_file(request: Request) -> Response:
    gateway = request.app.state.gateway
    meta = await file_of(gateway.batches, request.path_params["file_id"],
                         gateway.owner(request))
    return JSONResponse(objects.file_object(meta))


async def delete_file(request: Request) -> Response:
    gateway = request.app.state.gateway
    file_id, owner = request.path_params["file_id"], gateway.owner(request)
    await file_of(gateway.batches, file_id, owner)
    await gateway.batches.drop_file(file_id, owner)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: Request) -> Response:
    """The file's lines, streamed a window at a time; a running batch's output and error
    files answer with what is done so far."""
    gateway = request.app.state.gateway
    file_id, owner = request.path_params["file_id"], gateway.owner(request)
    store: BatchStore = gateway.batches
    found = keys.OUTPUT_FILE.fullmatch(file_id)
    if found:
        batch = await store.batch_meta(found.group(1))
        if not batch or objects.text(batch, "owner") != owner:
            raise no_such_file(file_id)
        return StreamingResponse(output_lines(store, file_id),
                                 media_type="application/octet-stream")
    meta = await file_of(store, file_id, owner)
    return StreamingResponse(input_lines(store, file_id, objects.integer(meta, "lines") or 0),
                             media_type="application/octet-stream")


async def input_lines(store: BatchStore, file_id: str, count: int) -> AsyncIterator[bytes]:
    for start in range(0, count, READ_WINDOW):
        window = await store.read_lines(file_id, range(start, min(count, start + READ_WINDOW)))
        yield b"".join(line + b"\n" for line in window if line is not None)


async def output_lines(store: BatchStore, file_id: str) -> AsyncIterator[bytes]:
    start = 0
    while window := await store.read_output(file_id, start, READ_WINDOW):
        yield b"".join(line + b"\n" for line in window)
        start += len(window)
