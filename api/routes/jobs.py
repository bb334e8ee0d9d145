"""Single jobs: submit (JSON chat-completions body, or multipart prompt + image files), read, list, cancel."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import UploadFile

from api.auth import TenantDep
from api.deps import AppState, SessionDep, StateDep
from api.errors import error_responses
from api.job_intake import submit
from api.json_body import INLINE_BODY_BYTES, body_schema, parse, validate
from api.limits import open_jobs_guard
from common.broker.queue import send_finalize_batch, tell_workers_to_check_leases
from common.domain import batches, jobs, storable
from common.domain.models import Job, JobStatus
from common.domain.schemas import JobCreate, JobList, JobView
from common.domain.submission import SubmissionError
from common.domain.views import job_view, row_completion
from common.images.stored import image_public_id, store_image
from common.infra.storage import ObjectNotFound

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_FORM_SCALARS = ("model", "max_tokens", "temperature", "top_p", "seed", "priority")
_FORM_FIELDS = ("prompt", "image", "images", "system", "stop", "metadata", *_FORM_SCALARS)


# The body is read by hand (JSON or multipart), so FastAPI cannot document it: both forms are declared here.
_CREATE_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": body_schema(JobCreate), "example": {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
                "max_tokens": 16}},
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["prompt"],
                "properties": {
                    "prompt": {"type": "string", "description": "the user's turn: the images, then this text"},
                    "image": {"type": "array", "items": {"type": "string", "format": "binary"}},
                    "system": {"type": "string"},
                    "model": {"type": "string"},
                    "max_tokens": {"type": "integer", "minimum": 1},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                    "seed": {"type": "integer"},
                    "priority": {"type": "integer", "minimum": 0, "maximum": 9},
                    "stop": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    "metadata": {"type": "string", "description": "a JSON object"},
                },
            }},
        },
    }
}


async def _from_form(request: Request, state: AppState, tenant: str) -> JobCreate:
    form = await request.form(max_files=state.settings.max_images_per_job + 1, max_fields=64)
    prompt = form.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise SubmissionError("multipart field 'prompt' is required")
    unknown = sorted({key for key in form if key not in _FORM_FIELDS})
    if unknown:
        raise SubmissionError(f"unknown multipart field(s) {', '.join(map(repr, unknown))}; the fields are "
                              + ", ".join(_FORM_FIELDS))
    if any(not isinstance(f, UploadFile) for key in ("image", "images") for f in form.getlist(key)):
        raise SubmissionError("multipart field 'image' must be a file (an image's bytes, with a filename)")
    files = [f for key in ("image", "images") for f in form.getlist(key) if isinstance(f, UploadFile)]
    image_ids = []
    for upload in files:
        data = await upload.read(state.settings.max_image_bytes + 1)
        if not data:
            raise SubmissionError(f"uploaded image {upload.filename!r} is empty")
        record = await run_in_threadpool(_store, state, data, tenant)
        image_ids.append(image_public_id(record))
    # The images, then the prompt, whatever order the form's fields came in (clients order them as they like:
    # httpx sends fields before files), as LLaVA-1.5 lays out a turn; a model takes either order, or its chat
    # template fixes the layout (the demo model's does).
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": i}} for i in image_ids]
    content.append({"type": "text", "text": prompt})
    messages: list[dict[str, Any]] = []
    system = form.get("system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": content})
    payload: dict[str, Any] = {"messages": messages}
    for key in _FORM_SCALARS:
        value = form.get(key)
        if isinstance(value, str) and value != "":
            payload[key] = value
    stops = [s for s in form.getlist("stop") if isinstance(s, str) and s]
    if stops:
        payload["stop"] = stops
    metadata = form.get("metadata")
    if isinstance(metadata, str) and metadata:
        try:
            payload["metadata"] = storable.loads(metadata)
        except (ValueError, RecursionError):
            raise SubmissionError("multipart field 'metadata' must be a JSON object") from None
    return validate(payload, JobCreate)


def _store(state: AppState, data: bytes, tenant: str) -> str:
    with state.db.session() as session:
        return store_image(session, state.store, data, state.settings, tenant).id


@router.post("", status_code=202, response_model=JobView, dependencies=[Depends(open_jobs_guard)],
             openapi_extra=_CREATE_DOC,
             responses={200: {"model": JobView, "description": "The tenant's earlier job with this Idempotency-Key."},
                        **error_responses(400, 404, 413, 415)})
async def create_job(
    request: Request, state: StateDep, tenant: TenantDep,
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    large = False
    if content_type == "application/json":
        raw = await request.body()
        # A large body goes to the thread pool: parsed on the event loop, one of hundreds of thousands of
        # messages would hold up every other request for seconds.
        large = len(raw) > INLINE_BODY_BYTES
        req = await run_in_threadpool(parse, raw, JobCreate) if large else parse(raw, JobCreate)
    elif content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        req = await _from_form(request, state, tenant)
    else:
        raise HTTPException(415, f"unsupported content type {content_type or '(none)'!r}: send application/json "
                                 "(a chat-completions body) or multipart/form-data (prompt + image files)")
    body, created = await submit(request, state, tenant, req, idempotency_key, large=large)
    return Response(body, status_code=202 if created else 200, media_type="application/json")


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    tenant: TenantDep,
    status: JobStatus | None = None,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = Query(default=None, description="Cursor: the next_cursor of the previous page."),
) -> JobList:
    stmt = select(Job).where(Job.tenant == tenant).order_by(Job.id.desc()).limit(limit + 1)
    if status is not None:
        stmt = stmt.where(Job.status == status)
    if after:
        stmt = stmt.where(Job.id < after)
    rows = list(session.scalars(stmt))
    page = rows[:limit]
    has_more = len(rows) > limit
    return JobList(data=[job_view(j) for j in page], has_more=has_more,
                   next_cursor=page[-1].id if has_more and page else None)


def _get_job(session: Session, tenant: str, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None or job.tenant != tenant:  # another tenant's job does not exist for this one
        raise HTTPException(404, f"job {job_id!r} not found")
    return job


@router.get("/{job_id}", response_model=JobView, responses=error_responses(404))
def get_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobView:
    return job_view(_get_job(session, tenant, job_id))


@router.post("/{job_id}/cancel", response_model=JobView, responses=error_responses(404, 409))
def cancel_job(job_id: str, state: StateDep, tenant: TenantDep) -> JobView:
    with state.db.session() as session:
        job = _get_job(session, tenant, job_id)
        batch_id, was_running = job.batch_id, job.status == JobStatus.RUNNING
        cancelled = jobs.cancel(session, job_id)
        if not cancelled:
            session.refresh(job)
            if job.status != JobStatus.CANCELLED:
                raise HTTPException(409, f"job {job_id!r} is already {job.status} and cannot be cancelled")
        session.refresh(job)
        view = job_view(job)
    if cancelled and was_running:
        tell_workers_to_check_leases(state.celery, f"job {job_id}")  # its worker stops it now, not at its heartbeat
    if batch_id is not None:
        # The batch may have been waiting on this job alone.
        _after_batch_job_cancel(state, batch_id)
    return view


def _after_batch_job_cancel(state: AppState, batch_id: str) -> None:
    try:
        with state.db.session() as session:
            ready = not batches.has_open_jobs(session, batch_id)
        if ready:
            send_finalize_batch(state.celery, state.settings, batch_id)
    except Exception:
        # The job is cancelled either way; the periodic sweep finalizes the batch.
        log.exception("finalize check after cancelling a job of batch %s failed", batch_id)


@router.get("/{job_id}/result", responses=error_responses(404, 409))
def get_result(job_id: str, session: SessionDep, state: StateDep, tenant: TenantDep) -> Response:
    """The full chat.completion object: the one the worker stored for a single job, rendered from the row for a
    batch row (which has no object of its own)."""
    job = _get_job(session, tenant, job_id)
    if job.status != JobStatus.SUCCEEDED:
        raise HTTPException(409, f"job {job_id!r} is {job.status}; a result exists only once it has succeeded")
    if not job.result_key:
        return Response(json.dumps(row_completion(job)), media_type="application/json")
    try:
        data = state.store.get(job.result_key)
    except ObjectNotFound:
        raise HTTPException(404, f"result object for job {job_id!r} is missing") from None
    return Response(data, media_type="application/json")
