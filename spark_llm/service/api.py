"""The HTTP API: OpenAI's Files and Batches routes over the store and the file storage. Each route is thin: check
the caller's key, parse with the shapes of :mod:`.protocol`, read or write records, answer OpenAI's shapes; the
scheduler does everything that touches Spark."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Optional

import sqlalchemy.exc
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..batch import Batch
from ..config import PRIORITIES
from ..endpoints import ENDPOINTS
from ..media import BY_PURPOSE
from . import monitor, ui, uploads, webhooks
from .access import Service, key_owner, new_id, own_batch, own_file, owner, service_of
from .door import FrontDoor
from .audit import audit
from .files import MEDIA_CHECKS, TextCheck, check_filename, paced, receive_upload
from .lifecycle import CANCELLABLE, Status
from .protocol import APIError, BatchCreate, ExpiresAfter, FileDeleted, FileObject, Page
from .settings import NO_KEY_OWNER
from .store import BatchRecord, FileRecord

log = logging.getLogger(__name__)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="spark_llm batch service", summary="OpenAI's Files and Batches API on a Spark cluster")
    app.state.service = service
    app.include_router(files_router, prefix="/v1")
    app.include_router(batches_router, prefix="/v1")
    app.include_router(uploads.router, prefix="/v1")
    app.include_router(webhooks.router, prefix="/v1")
    app.include_router(monitor.router)
    app.include_router(ui.router)
    app.add_middleware(FrontDoor, keys=lambda: service.keys)  # inside the audit: its refusals are audited too

    @app.middleware("http")
    async def audited(request: Request, call_next: Any) -> Any:
        """One audit line per API call: the key's owner id, the call, its answer's status and time."""
        t0 = time.monotonic()
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            keys = service.keys
            who = key_owner(keys, request.headers.get("authorization", "")) or "unknown" if keys else NO_KEY_OWNER
            audit("api", owner=who, method=request.method, path=request.url.path, status=response.status_code,
                  ms=round(1000 * (time.monotonic() - t0), 1))
        return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(where) or None
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}." if param else str(first.get("msg"))
        return JSONResponse(APIError.invalid(message, param=param).body(), status_code=400)

    @app.exception_handler(sqlalchemy.exc.DBAPIError)
    async def database_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("database error on %s %s: %s", request.method, request.url.path, str(exc).splitlines()[0])
        error = APIError(503, "The service's database is out of reach; try again shortly.", type="server_error")
        return JSONResponse(error.body(), status_code=503)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = "Not found: no such route." if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    return app


# ---- files -----------------------------------------------------------------------------------------------------------

files_router = APIRouter()


@files_router.post("/files")
async def create_file(request: Request, who: str = Depends(owner)) -> FileObject:
    service = service_of(request)
    id = new_id("file-")
    location = service.files.location("files", id)
    def check(fields: dict[str, str]) -> Any:  # the purpose comes before the file (openai-python sends it so)
        medium = BY_PURPOSE.get(fields.get("purpose", ""))
        if medium is not None:  # an image or an audio file, within the job's limit for it
            return MEDIA_CHECKS[medium](getattr(service.scheduler.base, medium.limit_setting))
        return TextCheck(service.settings.max_file_bytes)
    body = paced(request.stream(), service.settings.upload_idle_seconds)
    upload = await receive_upload(body, request.headers.get("content-type", ""), service.files, location, check)
    try:
        purpose = upload.fields.get("purpose")
        if purpose != "batch" and purpose not in BY_PURPOSE:
            raise APIError.invalid(f"This server takes files with purpose 'batch' (batch input files), 'vision' "
                                   f"(images a batch's requests name by file_id) or 'user_data' (audio files its "
                                   f"transcriptions name by file); got {purpose!r}.", param="purpose")
        filename = check_filename(upload.filename)
        expires_after = _expires_after(upload.fields)
    except APIError:
        service.files.delete(location)
        raise
    now = int(time.time())
    record = FileRecord(id=id, owner=who, filename=filename, purpose=purpose, bytes=upload.bytes, created_at=now,
                        location=location, expires_at=now + expires_after.seconds if expires_after else None)
    service.store.add_file(record)
    audit("file.created", owner=who, file=id, bytes=upload.bytes)
    log.info("file %s: %d bytes uploaded", id, upload.bytes)
    return FileObject.of(record)


def _expires_after(fields: dict[str, str]) -> Optional[ExpiresAfter]:
    """``expires_after[anchor]`` / ``expires_after[seconds]`` form fields (openai-python's encoding)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    try:
        return ExpiresAfter(anchor=anchor, seconds=int(seconds or ""))  # type: ignore[arg-type]
    except ValueError:
        raise APIError.invalid("expires_after needs anchor 'created_at' and seconds from 3600 to 2592000.",
                               param="expires_after") from None


@files_router.get("/files")
def list_files(request: Request, who: str = Depends(owner), purpose: Optional[str] = None,
               limit: int = Query(10_000, ge=1, le=10_000), after: Optional[str] = None,
               order: str = Query("desc", pattern="^(asc|desc)$")) -> Page[FileObject]:
    records, more = service_of(request).store.files(who, purpose, limit, after, newest_first=order == "desc")
    return Page.of([FileObject.of(r) for r in records], more)


@files_router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str, who: str = Depends(owner)) -> FileObject:
    return FileObject.of(own_file(request, file_id, who))


@files_router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str, who: str = Depends(owner)) -> StreamingResponse:
    record = own_file(request, file_id, who)
    try:
        chunks: Iterator[bytes] = service_of(request).files.chunks(record.location)
    except FileNotFoundError:  # deleted since its record was read: gone, as the delete says
        raise APIError.not_found("file", file_id) from None
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes)})


@files_router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str, who: str = Depends(owner)) -> FileDeleted:
    service = service_of(request)
    record = own_file(request, file_id, who)
    reader = service.store.delete_file(file_id)
    if reader is not None:
        raise APIError.invalid(f"The file is the input of batch {reader.id}, which has not finished; delete it "
                               "once the batch is done (or cancel the batch).", param="file_id")
    service.files.delete(record.location)
    audit("file.deleted", owner=who, file=file_id)
    return FileDeleted(id=file_id)


# ---- batches ---------------------------------------------------------------------------------------------------------

batches_router = APIRouter()


@batches_router.post("/batches")
def create_batch(request: Request, body: BatchCreate, who: str = Depends(owner)) -> Batch:
    service = service_of(request)
    if body.endpoint not in ENDPOINTS:
        raise APIError.invalid(f"Unsupported endpoint {body.endpoint!r}; this server runs "
                               f"{', '.join(sorted(ENDPOINTS))}.", param="endpoint", code="unsupported_endpoint")
    windows = service.settings.windows()
    if body.completion_window not in windows:
        raise APIError.invalid(f"completion_window must be one of {', '.join(windows)}; got "
                               f"{body.completion_window!r}.", param="completion_window")
    source = service.store.file(body.input_file_id, owner=who)
    if source is None:
        raise APIError.not_found("file", body.input_file_id)
    if source.purpose != "batch":
        raise APIError.invalid(f"File {source.id} has purpose {source.purpose!r}; a batch's input file is uploaded "
                               "with purpose 'batch'.", param="input_file_id")
    policy = service.settings.policy(who)
    priority = (body.metadata or {}).get("priority", policy.priority)
    if priority not in PRIORITIES:
        raise APIError.invalid(f"metadata.priority must be one of {', '.join(PRIORITIES)}; got {priority!r}.",
                               param="metadata")
    if policy.max_queued_batches is not None and \
            len(service.store.unfinished_of(who)) >= policy.max_queued_batches:
        raise APIError(429, f"This key has {policy.max_queued_batches} unfinished batches, its limit; create more "
                       "once some finish.", type="rate_limit_error", code="rate_limit_exceeded")
    now = int(time.time())
    record = BatchRecord(id=new_id("batch_"), owner=who, status=Status.VALIDATING, endpoint=body.endpoint,
                         input_file_id=source.id, completion_window=body.completion_window, created_at=now,
                         expires_at=now + windows[body.completion_window], metadata=body.metadata,
                         output_expires_after=body.output_expires_after.seconds if body.output_expires_after
                         else None, priority=priority)
    if not service.store.add_batch(record):  # the file was deleted since it was looked up
        raise APIError.not_found("file", body.input_file_id)
    audit("batch.created", owner=who, batch=record.id, file=source.id, endpoint=body.endpoint, priority=priority)
    service.scheduler.wake()
    log.info("batch %s: created over %s (%s)", record.id, source.id, body.endpoint)
    return record.api_object()


@batches_router.get("/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str, who: str = Depends(owner)) -> Batch:
    return own_batch(request, batch_id, who).api_object()


@batches_router.get("/batches")
def list_batches(request: Request, who: str = Depends(owner), limit: int = Query(20, ge=1, le=100),
                 after: Optional[str] = None) -> Page[Batch]:
    records, more = service_of(request).store.batches(who, limit, after)
    return Page.of([r.api_object() for r in records], more)


@batches_router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str, who: str = Depends(owner)) -> Batch:
    service = service_of(request)
    batch = own_batch(request, batch_id, who)
    if batch.status is Status.CANCELLING:
        return batch.api_object()
    moved = service.store.move(batch_id, Status.CANCELLING) if batch.status in CANCELLABLE else None
    if moved is None:
        now = service.store.batch(batch_id) or batch
        raise APIError.invalid(f"Cannot cancel a batch that is {now.status.value}.", param="batch_id")
    service.scheduler.wake()
    log.info("batch %s: cancel requested", batch_id)
    return moved.api_object()


