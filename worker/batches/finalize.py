"""Batch finalization and cancellation: the output and error JSONL files, then `completed` or `cancelled`.

The lines are built from the job rows alone (SQL is the truth, and a row holds all its result object does):
no object is read per job. Reading each result object back cost an S3 GET a line, ~350 lines/s against
moto, and could disagree with the row (a worker that lost its lease overwrites the object, not the row).

No Celery here. Finalization is safe to run twice or concurrently: the files go to deterministic keys with
content fixed by the (terminal) jobs, and the file rows commit in the same transaction as the one conditional
UPDATE that ends the batch, so exactly one run's rows survive.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from common.domain import batches, jobs
from common.domain.batch_input import JOB_LINE_COLUMNS, LineError, job_line, refused_line
from common.domain.file_expiry import ExpiresAfter
from common.domain.files import ObjectWriter, add_file, open_writer
from common.domain.models import Batch, BatchLineError, BatchStatus, FileRecord, Job, JobStatus, new_file_id
from common.infra.db import Database, rowcount
from common.infra.storage import ObjectStore, tenant_prefix

log = logging.getLogger(__name__)

ROWS_PER_READ = 1000  # job rows read at a time
CANCEL_CHUNK = 1000


class _Lost(Exception):
    """Another finalizer ended the batch first; this run's file rows are rolled back."""


@dataclass
class _Tally:
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class _JsonlObject:
    """A JSONL object written on first use, so a batch without errors gets no error file."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key
        self.writer: ObjectWriter | None = None
        self.pending = bytearray()
        self.size = 0

    def add(self, line: dict[str, Any]) -> None:
        if self.writer is None:
            self.writer = open_writer(self.store, self.key, "application/jsonl")
        self.pending += (json.dumps(line, ensure_ascii=False) + "\n").encode()
        if len(self.pending) >= 1 << 20:
            self.writer.write(bytes(self.pending))
            self.pending.clear()

    def close(self) -> int | None:
        """The object's size, or None when nothing was written."""
        if self.writer is None:
            return None
        if self.pending:
            self.writer.write(bytes(self.pending))
        return self.writer.close()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def output_key(batch_id: str, tenant: str) -> str:
    return f"{tenant_prefix(tenant)}batches/{batch_id}/output.jsonl"


def error_key(batch_id: str, tenant: str) -> str:
    return f"{tenant_prefix(tenant)}batches/{batch_id}/errors.jsonl"


# Told whenever a batch ends in this process, so that `vlmq run` learns of its batch's end at once instead of
# at its next look.
_batch_ended = threading.Condition()


def wait_for_a_batch_end(timeout: float) -> None:
    """Until a batch ends in this process, or `timeout` seconds."""
    with _batch_ended:
        _batch_ended.wait(timeout)


def finalize_batch(batch_id: str, db: Database, store: ObjectStore) -> str:
    """End the batch if all its jobs are terminal; returns its status afterwards."""
    try:
        return _finalize_batch(batch_id, db, store)
    finally:
        with _batch_ended:
            _batch_ended.notify_all()


def _finalize_batch(batch_id: str, db: Database, store: ObjectStore) -> str:
    final: BatchStatus | None
    with db.session() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return "missing"
        if batch.status == BatchStatus.IN_PROGRESS:
            if not batches.begin_finalizing(session, batch_id):
                # Some job is still queued or running, or another finalizer (or a cancel) got there first.
                return session.scalar(select(Batch.status).where(Batch.id == batch_id)) or "missing"
            final = BatchStatus.COMPLETED
        elif batch.status == BatchStatus.FINALIZING:
            # A redelivery after a finalizer died, or an expiring batch once its open jobs are cancelled.
            if batches.has_open_jobs(session, batch_id):
                return batch.status
            final = BatchStatus.EXPIRED if batch.expired_at is not None else BatchStatus.COMPLETED
        elif batch.status == BatchStatus.CANCELLING:
            if batches.has_open_jobs(session, batch_id):
                return batch.status  # the cancel task has not yet gone through all its jobs
            final = BatchStatus.CANCELLED
        elif batch.status == BatchStatus.FAILED and batch.refused_requests and batch.error_file_id is None:
            final = None  # failed at ingestion: its refusals get their error file, outside this session
        else:
            return batch.status
        tenant, status, expiry = batch.tenant, batch.status, _output_expiry(batch)
    if final is None:
        # Not inside the session above: on SQLite it holds the write lock, which _attach_refusals's own
        # sessions would wait on until the busy timeout (every attempt failed, and every writer waited).
        _attach_refusals(batch_id, tenant, db, store, expiry)
        return status
    output, errors = _JsonlObject(store, output_key(batch_id, tenant)), _JsonlObject(store, error_key(batch_id, tenant))
    try:
        stopped_code = "batch_expired" if final == BatchStatus.EXPIRED else "batch_cancelled"
        tally = _write_lines(batch_id, db, output, errors, stopped_code)
        output_size, error_size = output.close(), errors.close()
    except BaseException:
        output.abort()
        errors.abort()
        raise
    try:
        with db.session() as session:
            values: dict[str, Any] = {
                "completed_requests": tally.completed, "failed_requests": tally.failed,
                "input_tokens": tally.input_tokens, "output_tokens": tally.output_tokens,
            }
            for kind, key, size in (("output", output_key(batch_id, tenant), output_size),
                                    ("error", error_key(batch_id, tenant), error_size)):
                if size is not None:
                    values[f"{kind}_file_id"] = _add_output_file(session, batch_id, tenant, kind, key, size,
                                                                 expiry).id
            if not batches.finish(session, batch_id, final, **values):
                raise _Lost()
    except _Lost:
        log.info("batch %s was finalized by another run", batch_id)
    with db.session() as session:
        return session.scalar(select(Batch.status).where(Batch.id == batch_id)) or "missing"


def _attach_refusals(batch_id: str, tenant: str, db: Database, store: ObjectStore,
                     expiry: ExpiresAfter | None) -> None:
    """A batch none of whose lines could run failed at ingestion, its `errors` listing the first 100 (OpenAI's
    shape); every refused line still gets its line in an error file, as in any other batch."""
    output, errors = _JsonlObject(store, output_key(batch_id, tenant)), _JsonlObject(store, error_key(batch_id, tenant))
    try:
        _write_lines(batch_id, db, output, errors, "batch_cancelled")
        output.abort()  # no line became a job, so nothing was opened; should one have, it is not this file's
        size = errors.close()
    except BaseException:
        errors.abort()
        raise
    if size is None:
        return
    with db.session() as session:
        record = _add_output_file(session, batch_id, tenant, "error", error_key(batch_id, tenant), size, expiry)
        attached = rowcount(session,
            update(Batch).where(Batch.id == batch_id, Batch.error_file_id.is_(None))
            .values(error_file_id=record.id).execution_options(synchronize_session=False))
        if not attached:  # a concurrent finalizer attached its record of the same object first
            session.delete(record)


def _output_expiry(batch: Batch) -> ExpiresAfter | None:
    seconds = batch.output_expires_seconds
    return None if seconds is None else ExpiresAfter(anchor="created_at", seconds=seconds)


def _add_output_file(session: Session, batch_id: str, tenant: str, kind: str, key: str, size: int,
                     expiry: ExpiresAfter | None) -> FileRecord:
    """The file record of a batch's output or error JSONL, already written under `key`."""
    return add_file(session, file_id=new_file_id(), key=key, size=size, filename=f"{batch_id}_{kind}.jsonl",
                    purpose="batch_output", tenant=tenant, expires_after=expiry)


def _write_lines(batch_id: str, db: Database, output: _JsonlObject, errors: _JsonlObject,
                 stopped_code: str) -> _Tally:
    tally = _Tally()
    with db.session() as session:
        refused = (select(BatchLineError).where(BatchLineError.batch_id == batch_id)
                   .order_by(BatchLineError.line).execution_options(yield_per=ROWS_PER_READ))
        for err in session.scalars(refused):
            tally.failed += 1
            error = LineError(err.line, err.custom_id, err.code, err.message)
            errors.add(refused_line(error, f"batch_req_{batch_id}_line{err.line}"))
        stmt = (select(*JOB_LINE_COLUMNS).where(Job.batch_id == batch_id).order_by(Job.id)
                .execution_options(yield_per=ROWS_PER_READ))
        for job in session.execute(stmt):
            line = job_line(job, stopped_code)
            if job.status == JobStatus.SUCCEEDED:
                tally.completed += 1
                tally.input_tokens += job.prompt_tokens or 0
                tally.output_tokens += job.completion_tokens or 0
                output.add(line)
            else:
                if job.status in (JobStatus.FAILED, JobStatus.DEAD):
                    tally.failed += 1
                errors.add(line)
    return tally


# Told, after running jobs were cancelled, to have the workers look at once which jobs they still hold: each
# stops those it no longer does (worker/jobs/leases.py) instead of at its next heartbeat.
TellWorkers = Callable[[], None]


def cancel_batch_jobs(batch_id: str, db: Database, tell_workers: TellWorkers | None = None) -> int:
    """Cancel every open job of a cancelling batch, running ones included (OpenAI's cancel: what completed stays
    in the output file, nothing more runs): a running job's finish is then refused, and its worker, once told,
    aborts its generation. Returns how many were cancelled."""
    return _stop_open_jobs(batch_id, db, BatchStatus.CANCELLING, tell_workers)


def expire_batch(batch_id: str, db: Database, tell_workers: TellWorkers | None = None) -> int:
    """Cancel every open job of an expiring batch, running ones included: past its window nothing more runs
    (a worker's finish is refused, and its lease keeper aborts the generation)."""
    return _stop_open_jobs(batch_id, db, BatchStatus.FINALIZING, tell_workers)


def _stop_open_jobs(batch_id: str, db: Database, batch_status: BatchStatus, tell_workers: TellWorkers | None) -> int:
    """The running jobs first: they are what holds workers' slots and the engine, and a batch may have a million
    queued rows to go through after them. Then every open one, queued or claimed by a worker meanwhile (dispatch
    may still send the batch's rows until they are cancelled); the workers are told again if any was running.
    When this returns, no job of the batch is open."""
    running, _ = _cancel_jobs(batch_id, db, (batch_status,), (JobStatus.RUNNING,))
    if running:
        _tell(tell_workers, batch_id)
    rest, claimed_meanwhile = _cancel_jobs(batch_id, db, (batch_status,), (JobStatus.QUEUED, JobStatus.RUNNING))
    if claimed_meanwhile:
        _tell(tell_workers, batch_id)
    return running + rest


def _tell(tell_workers: TellWorkers | None, batch_id: str) -> None:
    if tell_workers is None:
        return
    try:
        tell_workers()
    except Exception:  # the jobs are cancelled in SQL all the same; each worker's heartbeat still finds them
        log.warning("batch %s: could not tell the workers that its running jobs were cancelled", batch_id,
                    exc_info=True)


def _cancel_jobs(batch_id: str, db: Database, batch_statuses: tuple[str, ...],
                 job_statuses: tuple[str, ...]) -> tuple[int, bool]:
    """Cancel the batch's jobs in `job_statuses`, CANCEL_CHUNK to a statement, while the batch is in one of
    `batch_statuses`: (how many, whether any of them was running)."""
    cancelled, any_running = 0, False
    while True:
        with db.session() as session:
            status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
            if status not in batch_statuses:
                return cancelled, any_running
            rows = session.execute(select(Job.id, Job.status)
                                   .where(Job.batch_id == batch_id, Job.status.in_(job_statuses))
                                   .limit(CANCEL_CHUNK)).all()
            # A row claimed, or requeued by the reaper, since the SELECT is open still: cancelled all the same.
            cancelled += jobs.cancel_many(session, [row.id for row in rows])
            any_running = any_running or any(row.status == JobStatus.RUNNING for row in rows)
        if len(rows) < CANCEL_CHUNK:
            return cancelled, any_running


def expire_due(db: Database) -> list[str]:
    """Move every batch past its completion window to finalizing (expired_at set); returns those whose open
    jobs expire_batch must now cancel."""
    with db.session() as session:
        due = batches.due_for_expiry(session)
    for batch_id in due:
        with db.session() as session:
            batches.expire(session, batch_id)  # a no-op for one already expiring
    return due


def due_batches(db: Database) -> list[str]:
    with db.session() as session:
        return batches.due_for_finalize(session)
