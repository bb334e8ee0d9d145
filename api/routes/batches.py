"""OpenAI Batches API: create a batch from an uploaded file, read it, list, cancel.

The API only writes the batch row (and, on a cancel, stops its running rows) and sends tasks by name:
ingestion, cancellation and finalization run on the ingest queue.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import TenantDep
from api.deps import AppState, SessionDep, StateDep
from api.errors import error_responses
from api.limits import open_jobs_guard
from api.routes.files import list_page
from common.broker.queue import send_cancel_batch, send_ingest_batch, tell_workers_to_check_leases
from common.domain import batches, jobs
from common.domain.batch_input import CHAT_URL
from common.domain.file_expiry import ExpiresAfter
from common.domain.models import Batch, BatchStatus, FileRecord
from common.domain.schemas import StorableBody
from common.domain.submission import SubmissionError, resolve_model

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches", tags=["batches"])

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchCreate(StorableBody):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # The output and error files expire this long after they are written (common/domain/file_expiry.py).
    output_expires_after: ExpiresAfter | None = None
    # vlmq extension (openai client: extra_body): a zip or tar of images that input lines name by relative
    # path, e.g. {"type": "image_url", "image_url": {"url": "images/cat.png"}}; CSV input files need one too.
    images_file_id: str | None = None


def _check(body: BatchCreate) -> None:
    if body.endpoint != CHAT_URL:
        raise SubmissionError(f"endpoint {body.endpoint!r} is not supported: vlmq batches run {CHAT_URL} only")
    if body.completion_window not in batches.COMPLETION_WINDOWS:
        raise SubmissionError(f"completion_window {body.completion_window!r} is not supported: use "
                              + " or ".join(repr(w) for w in batches.COMPLETION_WINDOWS))
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise SubmissionError(f"metadata may hold at most {MAX_METADATA_PAIRS} key-value pairs")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise SubmissionError(f"metadata keys are limited to {MAX_METADATA_KEY} characters and values to "
                                  f"{MAX_METADATA_VALUE} (key {key[:80]!r})")


def _get(session: Session, tenant: str, batch_id: str) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None or batch.tenant != tenant:
        raise HTTPException(404, f"no such batch: {batch_id!r}")
    return batch


def _input_file(session: Session, tenant: str, file_id: str, param: str) -> FileRecord:
    record = session.get(FileRecord, file_id)
    if record is None or record.tenant != tenant:
        raise SubmissionError(f"{param} {file_id!r}: no such file (upload it with POST /v1/files, "
                              "purpose='batch')", 404, "not_found")
    if record.purpose != "batch":
        raise SubmissionError(f"file {record.id!r} has purpose {record.purpose!r}; a batch input needs purpose "
                              "'batch'")
    return record


def create(state: AppState, tenant: str, body: BatchCreate) -> dict[str, Any]:
    """Check the request, write the batch row, send its ingestion; the new batch object."""
    _check(body)
    model = resolve_model(None, state.settings)  # 503 when this deployment serves no model
    with state.db.session() as session:
        record = _input_file(session, tenant, body.input_file_id, "input_file_id")
        if body.images_file_id is not None:
            _input_file(session, tenant, body.images_file_id, "images_file_id")
        batch = batches.create_batch(session, input_file_id=record.id, endpoint=body.endpoint,
                                     completion_window=body.completion_window, model=model,
                                     metadata=body.metadata, images_file_id=body.images_file_id, tenant=tenant,
                                     output_expires_seconds=body.output_expires_after.seconds
                                     if body.output_expires_after is not None else None)
        batch_id = batch.id
    try:
        send_ingest_batch(state.celery, state.settings, batch_id)
    except Exception:
        # Nothing would ever ingest it: end it as failed now rather than leave it validating forever.
        log.exception("could not dispatch ingestion of batch %s", batch_id)
        with state.db.session() as session:
            batches.fail(session, batch_id, [{"code": "dispatch_failed", "line": None, "param": None,
                                              "message": "the task queue is unavailable; create the batch again"}])
        raise HTTPException(503, "the task queue is unavailable; retry shortly",
                            headers={"Retry-After": "5"}) from None
    with state.db.session() as session:
        return batches.batch_view(session, _get(session, tenant, batch_id))


@router.post("", dependencies=[Depends(open_jobs_guard)], responses=error_responses(400, 404, 413))
def create_batch(body: BatchCreate, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    return create(state, tenant, body)


@router.get("")
def list_batches(
    session: SessionDep,
    tenant: TenantDep,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = Query(default=None, description="Cursor: the last_id of the previous page."),
) -> dict[str, Any]:
    # Ids are time-ordered: newest first.
    stmt = select(Batch).where(Batch.tenant == tenant).order_by(Batch.id.desc()).limit(limit + 1)
    if after:
        stmt = stmt.where(Batch.id < after)
    return list_page(list(session.scalars(stmt)), limit, lambda b: batches.batch_view(session, b))


@router.get("/{batch_id}", responses=error_responses(404))
def retrieve_batch(batch_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
    return batches.batch_view(session, _get(session, tenant, batch_id))


@router.post("/{batch_id}/cancel", responses=error_responses(404, 409))
def cancel_batch(batch_id: str, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    """Every request not yet finished is cancelled, those running on a worker included (the worker stops them);
    the batch ends `cancelled` with files for what finished before."""
    with state.db.session() as session:
        batch = _get(session, tenant, batch_id)
        if not batches.request_cancel(session, batch_id):
            session.refresh(batch)
            if batch.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
                raise HTTPException(409, f"batch {batch_id!r} is {batch.status} and can no longer be cancelled")
            return batches.batch_view(session, batch)
        # The running rows are cancelled here, with the move to `cancelling`, and their workers told at once: none
        # of them finishes after this answer, and they stop now rather than when the cancel task comes round (a
        # worker busy with jobs, which may also consume the batch tasks' queue, takes its next task only as some
        # end). The task cancels the queued rows, which may be a million, and any claimed meanwhile.
        stopped = jobs.cancel_running_of_batch(session, batch_id)
    if stopped:
        tell_workers_to_check_leases(state.celery, f"batch {batch_id}")
    try:
        send_cancel_batch(state.celery, state.settings, batch_id)
    except Exception:
        # The batch is `cancelling` in SQL; the next finalize trigger or the sweep still ends it.
        log.exception("could not dispatch cancellation of batch %s", batch_id)
    with state.db.session() as session:
        return batches.batch_view(session, _get(session, tenant, batch_id))
