"""OpenAI Files API: upload a batch input file (streamed to object storage), list, read, download, delete."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import TenantDep
from api.deps import AppState, SessionDep, StateDep
from api.errors import error_responses
from api.upload import UploadedFile, receive_upload
from common.domain import batches
from common.domain.file_expiry import MAX_SECONDS, MIN_SECONDS, ExpiresAfter
from common.domain.files import add_file, file_key, file_view, open_reader
from common.domain.models import FileRecord, new_file_id
from common.domain.submission import SubmissionError
from common.infra.storage import ObjectNotFound

router = APIRouter(prefix="/v1/files", tags=["files"])

_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file", "purpose"],
            "properties": {"file": {"type": "string", "format": "binary"},
                           "purpose": {"type": "string", "enum": ["batch"]}},
        }}},
    }
}


def list_page(items: Sequence[Any], limit: int, view: Any) -> dict[str, Any]:
    """OpenAI's cursor list: `items` holds up to limit + 1 rows, the extra one only says there is more."""
    page = list(items[:limit])
    return {"object": "list", "data": [view(row) for row in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(items) > limit}


def get_file(session: Session, tenant: str, file_id: str) -> FileRecord:
    record = session.get(FileRecord, file_id)
    if record is None or record.tenant != tenant:
        raise HTTPException(404, f"no such file: {file_id!r}")
    return record


def add_uploaded(state: AppState, tenant: str, file_id: str, uploaded: UploadedFile,
                 expires_after: ExpiresAfter | None = None) -> dict[str, Any]:
    with state.db.session() as session:
        return file_view(add_file(session, file_id=file_id, key=uploaded.key, size=uploaded.size,
                                  filename=uploaded.filename, purpose="batch", tenant=tenant,
                                  expires_after=expires_after))


def _expires_after(fields: dict[str, str]) -> ExpiresAfter | None:
    """OpenAI's client sends `expires_after={"anchor": ..., "seconds": ...}` as two form fields."""
    given = {key[len("expires_after["):-1]: value for key, value in fields.items()
             if key.startswith("expires_after[") and key.endswith("]")}
    if "expires_after" in fields:
        raise SubmissionError("expires_after must be sent as the fields expires_after[anchor] and "
                              "expires_after[seconds], as OpenAI's client sends it")
    if not given:
        return None
    try:
        return ExpiresAfter.model_validate(given)
    except ValidationError as exc:
        problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SubmissionError(f"expires_after must be {{anchor: 'created_at', seconds: {MIN_SECONDS}.."
                              f"{MAX_SECONDS}}}: {problem}") from None


def content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


@router.post("", openapi_extra=_UPLOAD_DOC, responses=error_responses(400, 413, 415))
async def create_file(request: Request, state: StateDep, tenant: TenantDep) -> JSONResponse:
    """Multipart `file` + `purpose=batch`. The file is streamed to object storage as it arrives."""
    if content_type(request) != "multipart/form-data":
        raise HTTPException(415, f"unsupported content type {content_type(request) or '(none)'!r}: upload the file "
                                 "as multipart/form-data with fields 'file' and 'purpose'")
    file_id = new_file_id()
    upload = await receive_upload(request, state.store, {"file": file_key(file_id, tenant)},
                                  state.settings.max_file_bytes)
    purpose = upload.fields.get("purpose")
    try:
        expires_after = _expires_after(upload.fields)
        problem = ("multipart field 'file' (the file) is required" if "file" not in upload.files
                   else "multipart field 'purpose' is required (vlmq accepts purpose='batch')" if purpose is None
                   else f"purpose {purpose!r} is not supported: vlmq stores batch input files and image archives "
                        "only (purpose='batch')" if purpose != "batch" else None)
        if problem is not None:
            raise SubmissionError(problem)
    except SubmissionError:
        if "file" in upload.files:  # refused: what was streamed to storage goes
            await run_in_threadpool(state.store.delete, file_key(file_id, tenant))
        raise
    return JSONResponse(await run_in_threadpool(add_uploaded, state, tenant, file_id, upload.files["file"],
                                                expires_after))


@router.get("")
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    purpose: str | None = None,
    limit: int = Query(default=10000, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = Query(default=None, description="Cursor: the last_id of the previous page."),
) -> dict[str, Any]:
    # Ids are time-ordered, so ordering by id is ordering by created_at.
    stmt = select(FileRecord).order_by(FileRecord.id.desc() if order == "desc" else FileRecord.id).limit(limit + 1)
    stmt = stmt.where(FileRecord.tenant == tenant)
    if purpose is not None:
        stmt = stmt.where(FileRecord.purpose == purpose)
    if after:
        stmt = stmt.where(FileRecord.id < after if order == "desc" else FileRecord.id > after)
    return list_page(list(session.scalars(stmt)), limit, file_view)


@router.get("/{file_id}", responses=error_responses(404))
def retrieve_file(file_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
    return file_view(get_file(session, tenant, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse, responses={
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The file's bytes."},
    **error_responses(404)})
def file_content(file_id: str, session: SessionDep, state: StateDep, tenant: TenantDep) -> StreamingResponse:
    """The file's bytes, streamed from object storage."""
    record = get_file(session, tenant, file_id)
    try:
        chunks = open_reader(state.store, record.object_key)
    except ObjectNotFound:
        raise HTTPException(404, f"the content of file {file_id!r} is missing from storage") from None
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={
        "Content-Length": str(record.size_bytes), "Content-Disposition": _attachment(record.filename, file_id),
    })


def _attachment(filename: str, fallback: str) -> str:
    """Content-Disposition for a client's file name: printable ASCII in `filename`, the whole name in
    `filename*` (RFC 6266); a header value cannot hold control characters at all."""
    ascii_name = "".join(c for c in filename if " " <= c <= "~" and c not in '"\\') or fallback
    full = "".join(c for c in filename if c.isprintable())
    if full == ascii_name:
        return f'attachment; filename="{ascii_name}"'
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(full, safe='')}"


@router.get("/{file_id}/url", responses=error_responses(404, 409))
def file_url(
    file_id: str, session: SessionDep, state: StateDep, tenant: TenantDep,
    expires_in: int | None = Query(default=None, ge=1, description="Seconds the URL works (default and most: "
                                                                     "the server's presign_expiry_seconds)."),
) -> dict[str, Any]:
    """vlmq extension: a presigned object-storage URL to download the file directly (large batch outputs
    need not pass through the API). Servers that keep objects in a local folder answer 409: use /content."""
    record = get_file(session, tenant, file_id)
    seconds = min(expires_in or state.settings.presign_expiry_seconds, state.settings.presign_expiry_seconds)
    url = state.store.presigned_url(record.object_key, seconds)
    if url is None:
        raise HTTPException(409, "this server keeps objects in a local folder, which has no presigned URLs; "
                                 f"download the file from /v1/files/{file_id}/content")
    return {"object": "file.url", "id": file_id, "url": url, "expires_at": int(time.time()) + seconds}


@router.delete("/{file_id}", responses=error_responses(404, 409))
def delete_file(file_id: str, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    with state.db.session() as session:
        record = get_file(session, tenant, file_id)
        busy = session.scalar(batches.ingesting(file_id).limit(1))
        if busy is not None:
            raise HTTPException(409, f"file {file_id!r} is being ingested by batch {busy!r}; delete it once "
                                     "that batch has left 'validating'")
        key = record.object_key
        session.delete(record)
    # The row goes first: a crash here leaves an unreferenced object, never a file whose content is gone.
    state.store.delete(key)
    return {"id": file_id, "object": "file", "deleted": True}
