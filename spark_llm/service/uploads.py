"""OpenAI's Uploads API: a large batch input file sent in parts (openai-python's
``client.uploads.upload_file_chunked``). ``POST /v1/uploads`` announces the file (name, purpose, size); each
``POST /v1/uploads/{id}/parts`` is written straight to storage as it arrives; ``.../complete`` puts the parts
together in the order given, into the file's place, checking the size announced, the MD5 when given, and that the
whole is JSONL text, as ``POST /v1/files`` does; ``.../cancel`` drops the parts. Nothing is held in memory: a part
or the whole goes through in chunks."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any, Optional

from fastapi import APIRouter, Depends, Request

from .access import owner, service_of
from .audit import audit
from .files import PartCheck, TextCheck, check_filename, paced, receive_upload
from .protocol import APIError, FileObject, Upload, UploadComplete, UploadCreate, UploadPart
from .store import FileRecord, PartRecord, UploadRecord

#: What OpenAI allows an upload: 8 GB in all, an hour to finish it.
MAX_UPLOAD_BYTES = 8 * 1000 ** 3
UPLOAD_SECONDS = 3600


router = APIRouter()


def upload_object(record: UploadRecord, file: Optional[FileObject] = None) -> Upload:
    status = "expired" if record.status == "pending" and time.time() >= record.expires_at else record.status
    return Upload(id=record.id, bytes=record.bytes, created_at=record.created_at, expires_at=record.expires_at,
                  filename=record.filename, purpose=record.purpose, status=status, file=file)


def pending(request: Request, upload_id: str, who: str) -> UploadRecord:
    record = service_of(request).store.upload(upload_id, who)
    if record is None:
        raise APIError.not_found("upload", upload_id)
    state = upload_object(record).status
    if state != "pending":
        raise APIError.invalid(f"Upload {upload_id} is {state}; only a pending upload takes parts, completes "
                               "or cancels.", param="upload_id")
    return record


@router.post("/uploads")
def create_upload(request: Request, body: UploadCreate, who: str = Depends(owner)) -> Upload:
    if body.purpose != "batch":
        raise APIError.invalid(f"This server takes uploads with purpose 'batch'; got {body.purpose!r}.",
                               param="purpose")
    if body.bytes > MAX_UPLOAD_BYTES:
        raise APIError.invalid(f"An upload holds at most {MAX_UPLOAD_BYTES} bytes; got {body.bytes}.",
                               param="bytes", code="file_too_large")
    now = int(time.time())
    record = UploadRecord(id="upload_" + uuid.uuid4().hex[:24], owner=who, filename=check_filename(body.filename),
                          purpose=body.purpose, bytes=body.bytes, mime_type=body.mime_type, created_at=now,
                          expires_at=now + UPLOAD_SECONDS, status="pending",
                          file_expires_after=body.expires_after.seconds if body.expires_after else None)
    service_of(request).store.add_upload(record)
    audit("upload.created", owner=who, upload=record.id, bytes=body.bytes)
    return upload_object(record)


@router.post("/uploads/{upload_id}/parts")
async def add_part(request: Request, upload_id: str, who: str = Depends(owner)) -> UploadPart:
    service = service_of(request)
    record = pending(request, upload_id, who)
    already = sum(p.bytes for p in service.store.parts(upload_id))
    id = "part_" + uuid.uuid4().hex[:24]
    location = service.files.location("uploads", upload_id, id)
    received = await receive_upload(paced(request.stream(), service.settings.upload_idle_seconds),
                                    request.headers.get("content-type", ""), service.files, location,
                                    PartCheck(record.bytes - already), field="data")
    now = int(time.time())
    service.store.add_part(PartRecord(id=id, upload_id=upload_id, bytes=received.bytes, created_at=now,
                                      location=location))
    return UploadPart(id=id, created_at=now, upload_id=upload_id)


@router.post("/uploads/{upload_id}/complete")
def complete_upload(request: Request, upload_id: str, body: UploadComplete, who: str = Depends(owner)) -> Upload:
    service = service_of(request)
    record = pending(request, upload_id, who)
    parts = {p.id: p for p in service.store.parts(upload_id)}
    unknown = [p for p in body.part_ids if p not in parts]
    if unknown or len(set(body.part_ids)) != len(body.part_ids):
        raise APIError.invalid(f"part_ids must list parts of this upload, each once; {unknown[:1] or 'a part'} "
                               "is not one.", param="part_ids")
    total = sum(parts[p].bytes for p in body.part_ids)
    if total != record.bytes:
        raise APIError.invalid(f"The parts hold {total} bytes; the upload was created for {record.bytes}.",
                               param="part_ids")
    file_id = "file-" + uuid.uuid4().hex[:24]
    location = service.files.location("files", file_id)
    ordered = [parts[p] for p in body.part_ids]
    # each part was checked as it came (no NUL byte, within the bytes); without an MD5 to compare, a file on S3 is
    # joined there from its parts (8 GB would otherwise pass through this server twice), once one part holds text
    if body.md5 or not any(part.bytes and not _blank(service, part.location) for part in ordered) or \
            not service.files.join([(part.location, part.bytes) for part in ordered], location):
        md5, check = hashlib.md5(), TextCheck(MAX_UPLOAD_BYTES)
        with service.files.writing(location) as out:  # the file appears whole, or not at all
            for part in ordered:
                for chunk in service.files.chunks(part.location):
                    check.feed(chunk)
                    md5.update(chunk)
                    out.write(chunk)
            check.close()
            if body.md5 and body.md5.lower() != md5.hexdigest():
                raise APIError.invalid(f"The parts' MD5 is {md5.hexdigest()}, not {body.md5}.", param="md5")
    now = int(time.time())
    file = FileRecord(id=file_id, owner=who, filename=record.filename, purpose=record.purpose, bytes=total,
                      created_at=now, location=location,
                      expires_at=now + record.file_expires_after if record.file_expires_after else None)
    if not service.store.end_upload(upload_id, "completed", file):
        service.files.delete(location)
        raise APIError.invalid(f"Upload {upload_id} was completed or cancelled meanwhile.", param="upload_id")
    for part in parts.values():
        service.files.delete(part.location)
    audit("upload.completed", owner=who, upload=upload_id, file=file_id, bytes=total, parts=len(body.part_ids))
    done = service.store.upload(upload_id, who)
    return upload_object(done, FileObject.of(file))


def _blank(service: Any, location: str) -> bool:
    """Whether a part holds only whitespace, read up to its first other byte (the first chunk, for a file of
    requests)."""
    return not any(chunk.strip() for chunk in service.files.chunks(location))


@router.post("/uploads/{upload_id}/cancel")
def cancel_upload(request: Request, upload_id: str, who: str = Depends(owner)) -> Upload:
    service = service_of(request)
    pending(request, upload_id, who)
    service.store.end_upload(upload_id, "cancelled")
    for part in service.store.parts(upload_id):
        service.files.delete(part.location)
    audit("upload.cancelled", owner=who, upload=upload_id)
    return upload_object(service.store.upload(upload_id, who))
