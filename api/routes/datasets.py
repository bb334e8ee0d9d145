"""Native datasets in one request: a manifest (JSONL or CSV) and a zip or tar of the images it names by path.

The same batch as POST /v1/files (twice) + POST /v1/batches with images_file_id: both files are streamed to
object storage, become files rows, and the batch object is answered.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from api.auth import TenantDep
from api.deps import StateDep
from api.errors import error_responses
from api.limits import open_jobs_guard
from api.routes.batches import BatchCreate, create
from api.routes.files import add_uploaded, content_type
from api.upload import receive_upload
from common.domain import storable
from common.domain.batch_input import CHAT_URL
from common.domain.files import discard_files, file_key
from common.domain.models import new_file_id
from common.domain.submission import SubmissionError

router = APIRouter(prefix="/v1/datasets", tags=["batches"])

_DOC = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["manifest"],
            "properties": {
                "manifest": {"type": "string", "format": "binary",
                             "description": "OpenAI batch JSONL, or CSV (prompt, image, custom_id, system, "
                                            "max_tokens, temperature, top_p, seed); images named by path"},
                "images": {"type": "string", "format": "binary", "description": "zip or tar(.gz) of the images"},
                "completion_window": {"type": "string", "enum": ["24h"]},
                "metadata": {"type": "string", "description": "a JSON object of string values"},
            },
        }}},
    }
}


_FIELDS = ("completion_window", "metadata")


def _body(fields: dict[str, str], manifest_id: str, images_id: str | None) -> BatchCreate:
    try:
        metadata = storable.loads(fields["metadata"]) if fields.get("metadata") else None
        return BatchCreate(input_file_id=manifest_id, endpoint=CHAT_URL, metadata=metadata,
                           completion_window=fields.get("completion_window") or "24h", images_file_id=images_id)
    except (ValueError, RecursionError, ValidationError):
        raise SubmissionError("multipart field 'metadata' must be a JSON object of string values") from None


@router.post("", openapi_extra=_DOC, dependencies=[Depends(open_jobs_guard)],
             responses=error_responses(400, 404, 413, 415))
async def create_dataset_batch(request: Request, state: StateDep, tenant: TenantDep) -> JSONResponse:
    if content_type(request) != "multipart/form-data":
        raise HTTPException(415, "send multipart/form-data with a 'manifest' file and an 'images' archive")
    ids = {"manifest": new_file_id(), "images": new_file_id()}
    upload = await receive_upload(request, state.store, {name: file_key(i, tenant) for name, i in ids.items()},
                                  state.settings.max_file_bytes)
    received = [ids[name] for name in upload.files]
    try:
        if "manifest" not in upload.files:
            raise SubmissionError("multipart field 'manifest' (the JSONL or CSV file) is required")
        if unknown := sorted(set(upload.fields) - set(_FIELDS)):
            raise SubmissionError(f"unknown multipart field(s) {', '.join(map(repr, unknown))}; besides the "
                                  f"'manifest' and 'images' files the fields are {', '.join(_FIELDS)}")
        body = _body(upload.fields, ids["manifest"], ids["images"] if "images" in upload.files else None)
        for name, uploaded in upload.files.items():
            await run_in_threadpool(add_uploaded, state, tenant, ids[name], uploaded)
        view: dict[str, Any] = await run_in_threadpool(create, state, tenant, body)
    except BaseException:
        await run_in_threadpool(discard_files, state.db, state.store, tenant, received)
        raise
    return JSONResponse(view)
