"""The batch state machine and the OpenAI `batch` object. Torch-free: used by the API and the ingest worker.

    validating --ingested--> in_progress --all jobs terminal--> finalizing --files written--> completed
        |   '--no valid line / unreadable file--> failed
        '--cancel--> cancelling <--cancel-- in_progress
        |                '--all jobs terminal--> cancelled
        '--past expires_at (also from in_progress while a job is open)--> finalizing (expired_at set)
                                                       --open jobs cancelled, files written--> expired

Every transition is one conditional UPDATE (like common/domain/jobs.py), so a redelivered task, two finalizers or a
cancel racing ingestion change a batch at most once.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, exists, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from common.domain.models import DEFAULT_TENANT, Batch, BatchStatus, Job, JobStatus, new_id, utcnow
from common.infra.db import rowcount
from common.infra.pg_bulk import insert_json_rows

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
RATE_WINDOW = timedelta(seconds=60)
OPEN_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)
# Counts of these batches are frozen in the row; the others are counted from their jobs on each read.
_FROZEN = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED)
# Batches that end when their last open job does (finalizing: an expiring batch whose jobs are being cancelled).
_WAITING = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)


def insert_ignoring_conflicts(
    session: Session, model: type[Any], rows: list[dict[str, Any]], conflict_columns: list[str],
    returning: Any = None,
) -> set[Any]:
    """Bulk INSERT .. ON CONFLICT (conflict_columns) DO NOTHING [RETURNING returning]: the values of
    `returning` for the rows actually written (an empty set without `returning`)."""
    if not rows:
        return set()
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        # One statement whose rows travel as one JSON parameter: its text never changes (parsed, planned once).
        return insert_json_rows(session, model, rows, conflict_columns,
                             None if returning is None else returning.property.columns[0].name)
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    else:
        raise RuntimeError(f"batches do not support the {dialect} database")
    stmt = dialect_insert(model).on_conflict_do_nothing(index_elements=conflict_columns)
    if returning is None:
        session.execute(stmt, rows)
        return set()
    return set(session.scalars(stmt.returning(returning), rows))


def create_batch(
    session: Session, *, input_file_id: str, endpoint: str, completion_window: str, model: str,
    metadata: dict[str, str] | None, images_file_id: str | None = None, tenant: str = DEFAULT_TENANT,
    output_expires_seconds: int | None = None,
) -> Batch:
    now = utcnow()
    batch = Batch(
        id=new_id("batch"), tenant=tenant, status=BatchStatus.VALIDATING, endpoint=endpoint,
        completion_window=completion_window,
        input_file_id=input_file_id, images_file_id=images_file_id, model=model, metadata_=metadata,
        output_expires_seconds=output_expires_seconds,
        created_at=now, expires_at=now + COMPLETION_WINDOWS[completion_window], ingested_lines=0, total_requests=0,
        refused_requests=0, completed_requests=0, failed_requests=0,
    )
    session.add(batch)
    session.flush()
    return batch


def _set(session: Session, batch_id: str, from_statuses: tuple[str, ...], **values: Any) -> bool:
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(from_statuses))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def start(session: Session, batch_id: str) -> bool:
    """validating -> in_progress, once every line is ingested."""
    return _set(session, batch_id, (BatchStatus.VALIDATING,), status=BatchStatus.IN_PROGRESS,
                in_progress_at=utcnow())


def advance_ingestion(
    session: Session, batch_id: str, *, from_line: int, last_line: int, requests: int, refused: int
) -> bool:
    """Record a chunk (lines after `from_line` up to `last_line`) in its own transaction.

    Refused (False) when the batch is no longer validating (cancelled) or another ingester moved the resume
    point (a redelivered message running beside the first): the caller rolls its chunk back and stops, so
    two ingesters never both write, and a custom_id one of them wrote is never reported as a duplicate."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING, Batch.ingested_lines == from_line)
        .values(ingested_lines=last_line, total_requests=Batch.total_requests + requests,
                refused_requests=Batch.refused_requests + refused)
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def finish(session: Session, batch_id: str, final: BatchStatus, **values: Any) -> bool:
    """finalizing -> completed|expired, or cancelling -> cancelled, with the files and frozen counts."""
    if final == BatchStatus.COMPLETED:
        return _set(session, batch_id, (BatchStatus.FINALIZING,), status=final, completed_at=utcnow(), **values)
    if final == BatchStatus.EXPIRED:
        return _set(session, batch_id, (BatchStatus.FINALIZING,), status=final, **values)
    return _set(session, batch_id, (BatchStatus.CANCELLING,), status=final, cancelled_at=utcnow(), **values)


def expire(session: Session, batch_id: str) -> bool:
    """validating|in_progress past its completion window -> finalizing, with expired_at set: its open jobs
    are cancelled next, then finalization ends it `expired` (finished results kept).

    An in_progress batch whose every job has ended is not late but finishing (its finalize is on the way),
    so it is left to end `completed`; the check is in the same statement as the move."""
    now = utcnow()
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.expires_at < now, _late(batch_id))
        .values(status=BatchStatus.FINALIZING, finalizing_at=now, expired_at=now)
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def due_for_expiry(session: Session) -> list[str]:
    """Batches past their window, and expiring ones that still have open jobs (a sweep died midway)."""
    past = select(Batch.id).where(Batch.expires_at < utcnow(), _late(Batch.id))
    expiring = select(Batch.id).where(Batch.status == BatchStatus.FINALIZING, Batch.expired_at.is_not(None),
                                      _open_jobs(Batch.id))
    return list(session.scalars(past.union(expiring)))


def fail(session: Session, batch_id: str, errors: list[dict[str, Any]]) -> bool:
    """validating -> failed: nothing in the file can run (OpenAI shows why in `errors`)."""
    return _set(session, batch_id, (BatchStatus.VALIDATING,), status=BatchStatus.FAILED, failed_at=utcnow(),
                errors=errors, completed_requests=0, failed_requests=Batch.refused_requests)


def request_cancel(session: Session, batch_id: str) -> bool:
    """validating|in_progress -> cancelling. The cancel task then stops its queued jobs."""
    return _set(session, batch_id, (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS),
                status=BatchStatus.CANCELLING, cancelling_at=utcnow())


def _late(batch_id: Any) -> Any:
    """Still short of done: ingesting, or running with some job queued or running."""
    return or_(Batch.status == BatchStatus.VALIDATING,
               and_(Batch.status == BatchStatus.IN_PROGRESS, _open_jobs(batch_id)))


def _open_jobs(batch_id: Any) -> Any:
    return exists().where(Job.batch_id == batch_id, Job.status.in_(OPEN_JOB_STATUSES))


def _no_open_jobs(batch_id: Any) -> Any:
    return ~_open_jobs(batch_id)


def begin_finalizing(session: Session, batch_id: str) -> bool:
    """in_progress -> finalizing, only when no job of the batch is queued or running (same statement)."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == BatchStatus.IN_PROGRESS, _no_open_jobs(batch_id))
        .values(status=BatchStatus.FINALIZING, finalizing_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def has_open_jobs(session: Session, batch_id: str) -> bool:
    return bool(session.scalar(select(_open_jobs(batch_id))))


def ready_after_job(session: Session, job_id: str) -> str | None:
    """The batch of a job that just ended, if that was the batch's last open job; else None.

    One indexed query per finished job (jobs by id, then ix_jobs_batch_id_status), so the finalize check can
    run on the hot path of every batch job."""
    job = aliased(Job)
    stmt = (
        select(job.batch_id)
        .join(Batch, Batch.id == job.batch_id)
        .where(job.id == job_id, Batch.status.in_(_WAITING), _no_open_jobs(job.batch_id))
    )
    return session.scalar(stmt)


def ingesting(file_id: Any) -> Select[str]:
    """The batches still ingesting (validating) a file, as input or image archive: `file_id` is an id, or a
    column to correlate with. Such a file may not be deleted yet."""
    return select(Batch.id).where(or_(Batch.input_file_id == file_id, Batch.images_file_id == file_id),
                                  Batch.status == BatchStatus.VALIDATING)


def validating_since(session: Session, before: datetime) -> list[str]:
    """Batches created before `before` and still being ingested (or waiting for their ingestion to start)."""
    return list(session.scalars(select(Batch.id).where(Batch.status == BatchStatus.VALIDATING,
                                                       Batch.created_at < before)))


def due_for_finalize(session: Session, stale_after: timedelta = timedelta(minutes=10)) -> list[str]:
    """Batches a finalize trigger may have missed: running or cancelling with no open job, or stuck in
    finalizing (a finalizer died and its message was lost)."""
    waiting = select(Batch.id).where(Batch.status.in_((BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING)),
                                     _no_open_jobs(Batch.id))
    stuck = select(Batch.id).where(Batch.status == BatchStatus.FINALIZING,
                                   Batch.finalizing_at < utcnow() - stale_after)
    return list(session.scalars(waiting.union(stuck)))


def request_counts(session: Session, batch: Batch) -> dict[str, int]:
    if batch.status in _FROZEN:
        completed, failed = batch.completed_requests, batch.failed_requests
    else:
        # An index-only count over (batch_id, status); a million-row batch costs a scan of its index range.
        rows = session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch.id).group_by(Job.status)
        ).all()
        by_status = {status: n for status, n in rows}
        completed = by_status.get(JobStatus.SUCCEEDED, 0)
        failed = batch.refused_requests + by_status.get(JobStatus.FAILED, 0) + by_status.get(JobStatus.DEAD, 0)
    return {"total": batch.total_requests, "completed": completed, "failed": failed}


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def progress(session: Session, batch: Batch, counts: dict[str, int]) -> dict[str, Any]:
    """vlmq's extension of the batch object: requests finished per second over the last RATE_WINDOW (or since
    the batch started, if later), and when the open ones should be done at that rate."""
    if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS) or batch.in_progress_at is None:
        return {"completion_rate": None, "estimated_completion_at": None}
    now = utcnow()
    since = max(now - RATE_WINDOW, batch.in_progress_at)
    recent = session.scalar(select(func.count()).select_from(Job).where(
        Job.batch_id == batch.id, Job.finished_at >= since)) or 0
    seconds = max((now - since).total_seconds(), 1.0)
    rate = recent / seconds
    open_requests = batch.total_requests - counts["completed"] - counts["failed"]
    eta = _ts(now + timedelta(seconds=open_requests / rate)) if rate > 0 and open_requests > 0 else None
    return {"completion_rate": round(rate, 3), "estimated_completion_at": eta}


def batch_view(session: Session, batch: Batch) -> dict[str, Any]:
    """The OpenAI `batch` object."""
    usage = None
    if batch.input_tokens is not None and batch.output_tokens is not None:
        usage = {"input_tokens": batch.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": batch.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": batch.input_tokens + batch.output_tokens}
    counts = request_counts(session, batch)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "images_file_id": batch.images_file_id,  # vlmq extension: the image archive of a native dataset
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at),
        "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at),
        "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at),
        "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at),
        "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": counts,
        "metadata": batch.metadata_,
        "usage": usage,
        **progress(session, batch, counts),  # completion_rate (requests/s), estimated_completion_at (unix s)
    }
