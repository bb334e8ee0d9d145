"""Batch ingestion: stream an input file, check every line, write job rows in chunks, dispatch them. No Celery.

The input is OpenAI batch JSONL, or a CSV manifest (worker/batches/dataset.py); with an image archive (a native
dataset) its images are stored and indexed first, and lines name them by relative path.

Memory stays bounded whatever the file's size: lines are read from object storage piece by piece, a chunk of
at most `ingest_chunk_rows` lines is held at a time (requests with images already replaced by content hashes),
and duplicate custom_ids are found by a unique index in SQL rather than a set of every id seen. The first chunk
holds `ingest_first_chunk_rows` lines and each next one doubles, so a batch's first jobs reach the workers
before a whole chunk of lines has been checked. Within a chunk, lines are checked a window at a time
(worker/batches/image_window.py): the data: URL images of a window are looked up and written with one SQL
statement each, not two per image.

Crash safety: a chunk's job rows, its refused lines and the batch's resume point (`ingested_lines`) commit in
one transaction. Job rows are written unsent; after each chunk, common.broker.dispatch tops up the tenant's window
of the model's queue (fair sharing between tenants), and later top-ups happen as jobs finish. A redelivered
task skips the committed lines and tops up first (a crash between commit and dispatch left rows unsent).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from common.broker import dispatch
from common.domain import batches
from common.domain.batch_input import LineError, duplicate_error, iter_lines
from common.domain.files import open_reader
from common.domain.models import Batch, BatchLineError, BatchStatus, FileRecord, Job, JobStatus, new_id, utcnow
from common.domain.submission import SubmissionError, normalize_request, resolve_model
from common.images.cache import ImageCache
from common.images.pack import ImagePack
from common.images.refs import ResolvedImage
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectNotFound, ObjectStore
from worker.batches.dataset import DatasetError, index_archive, iter_csv_lines, resolve_paths
from worker.batches.image_window import Parsed, WindowImages, read_window

log = logging.getLogger(__name__)

# A failed batch lists at most this many line errors (OpenAI's `errors.data`); the rest stay in the table.
MAX_LISTED_ERRORS = 100

# (settings of the batch's model, job ids, priority): sends run_job messages to that model's queue.
Dispatch = Callable[[Settings, list[str], int], Any]


@dataclass
class IngestDeps:
    settings: Settings
    db: Database
    store: ObjectStore
    dispatch: Dispatch
    # `vlmq run`: the file was written for some model, the command line decides which runs it.
    any_model: bool = False


class _Stopped(Exception):
    """The batch left `validating` (cancelled), or another ingester took over, while a chunk was being
    written: that chunk is rolled back."""


@dataclass
class _ChunkResult:
    job_ids: list[str]
    last_line: int
    exhausted: bool


@dataclass
class _Run:
    """One ingestion of one batch."""

    batch_id: str
    tenant: str
    model_settings: Settings  # the batch's model: its job queue and the model lines may name
    refused_ids: set[str]  # custom_ids of refused lines: a later line reusing one is a duplicate
    has_images: bool = False  # a native dataset: lines may name archive members by path
    images_root: str | None = None
    # Image references already resolved in this run: an image reused by many lines is checked once.
    images: ImageCache[ResolvedImage] = field(default_factory=ImageCache)
    # Where the batch's model's files are, when this process serves that model (prompts are measured
    # against its context); None: another model's batch, only the plain caps apply.
    model_files: str | None = None
    # Where each chunk's new images go, written as one object before the chunk commits; None: an object each.
    pack: ImagePack | None = None


def ingest_batch(batch_id: str, deps: IngestDeps) -> str:
    """Ingest a `validating` batch; returns its status afterwards (in_progress, failed, or what it already was).

    The caller sends finalize_batch afterwards whatever the status: the batch's jobs may all have finished
    while later chunks were still being read, and a cancelled ingestion still has to end `cancelled`."""
    with deps.db.session() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return "missing"
        if batch.status != BatchStatus.VALIDATING:
            return batch.status  # a duplicate delivery, or cancelled before ingestion began
        record = session.get(FileRecord, batch.input_file_id)
        key, filename = (record.object_key, record.filename) if record is not None else (None, "")
        resume_after, input_file_id = batch.ingested_lines, batch.input_file_id
        images_file_id, images_indexed = batch.images_file_id, batch.images_indexed_at is not None
        # Jobs go to the queue of the model the batch was created for, not whatever this process serves.
        run = _Run(batch_id, batch.tenant, deps.settings.model_copy(update={"served_model_name": batch.model}),
                   _refused_ids(session, batch_id) if resume_after else set(), images_file_id is not None,
                   model_files=deps.settings.model if batch.model == deps.settings.served_model_name else None,
                   pack=ImagePack.for_settings(deps.store, deps.settings))
    if key is None:
        return _fail(deps, batch_id, "file_not_found", f"input file {input_file_id!r} no longer exists")
    if images_file_id is not None and not images_indexed:
        problem = index_archive(batch_id, images_file_id, deps.db, deps.store, deps.settings, run.tenant)
        if problem is not None:
            return _fail(deps, batch_id, "invalid_archive", problem)
    with deps.db.session() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        if batch.status != BatchStatus.VALIDATING:
            return batch.status
        run.images_root = batch.images_root
    if resume_after:
        log.info("batch %s: resuming ingestion after line %d", batch_id, resume_after)
        _top_up(deps, run)
    try:
        chunks = open_reader(deps.store, key)
    except ObjectNotFound:
        return _fail(deps, batch_id, "file_unreadable", f"input file {input_file_id!r} is missing from storage")
    read = iter_csv_lines if filename.lower().endswith(".csv") else iter_lines
    lines = ((n, item) for n, item in read(chunks, deps.settings.max_body_bytes) if n > resume_after)
    done_line = resume_after
    sizes = chunk_sizes(deps.settings.ingest_first_chunk_rows, deps.settings.ingest_chunk_rows)
    while True:
        try:
            with deps.db.session() as session:
                result = _ingest_chunk(session, deps, run, lines, done_line, next(sizes))
        except _Stopped:
            log.info("batch %s: ingestion stopped (cancelled, or another ingester took over)", batch_id)
            with deps.db.session() as session:
                return _status(session, batch_id)
        except DatasetError as exc:  # a CSV manifest whose header is unusable
            return _fail(deps, batch_id, "invalid_manifest", str(exc))
        if result.job_ids:
            _top_up(deps, run)
        if result.exhausted:
            break
        done_line = result.last_line
    return _conclude(deps, batch_id)


def chunk_sizes(first: int, most: int) -> Iterator[int]:
    """Lines per chunk: `first`, doubling each chunk, never above `most`."""
    size = min(first, most)
    while True:
        yield size
        size = min(2 * size, most)


def _ingest_chunk(
    session: Session, deps: IngestDeps, run: _Run, lines: Iterator[tuple[int, str | LineError]], done_line: int,
    size: int,
) -> _ChunkResult:
    settings = deps.settings
    rows: list[dict[str, Any]] = []
    errors: list[LineError] = []
    line_of: dict[str, int] = {}  # custom_id -> line, for this chunk's accepted lines
    taken = last = 0
    now = utcnow()
    chunk = itertools.islice(lines, size)
    while True:
        # A window of lines at a time: its new images cost a few SQL round trips in all, not two each.
        images = WindowImages(session, deps.store, settings, run.tenant, run.pack, run.images)
        window = read_window(chunk, images)
        if not window:
            break
        images.lookup()
        for number, parsed in window:
            taken, last = taken + 1, number
            accepted = _accept(session, deps, run, number, parsed, line_of, images)
            if isinstance(accepted, LineError):
                errors.append(accepted)
                if accepted.custom_id:
                    run.refused_ids.add(accepted.custom_id)
                continue
            custom_id, request = accepted
            line_of[custom_id] = number
            rows.append({
                "id": new_id("job"), "tenant": run.tenant, "dispatched_at": None,
                "status": JobStatus.QUEUED, "model": run.model_settings.served_model_name,
                "priority": settings.batch_priority, "request": request, "metadata_": None,
                "idempotency_key": None, "batch_id": run.batch_id, "custom_id": custom_id, "line": number,
                "attempts": 0, "max_attempts": settings.max_attempts, "created_at": now,
            })
        images.store()
    if taken == 0:
        return _ChunkResult([], done_line, True)
    inserted = _insert_jobs(session, rows)
    # Not inserted: an earlier chunk already holds a job with this custom_id.
    errors += [duplicate_error(line_of[r["custom_id"]], r["custom_id"]) for r in rows if r["id"] not in inserted]
    if errors:
        session.execute(insert(BatchLineError), [
            {"batch_id": run.batch_id, "line": e.line, "custom_id": e.custom_id, "code": e.code,
             "message": e.message[:4000], "param": e.param} for e in errors
        ])
    if not batches.advance_ingestion(session, run.batch_id, from_line=done_line, last_line=last, requests=taken,
                                     refused=len(errors)):
        raise _Stopped()
    if run.pack is not None:
        run.pack.flush()  # before the commit that names its images
    return _ChunkResult([r["id"] for r in rows if r["id"] in inserted], last, taken < size)


def _accept(
    session: Session, deps: IngestDeps, run: _Run, number: int, parsed: Parsed, line_of: dict[str, int],
    images: WindowImages,
) -> tuple[str, dict[str, Any]] | LineError:
    """(custom_id, stored request) for a line that can run, else its error: the same checks as `vlmq run`
    and POST /v1/jobs, images validated and stored once under their content hash (through `images`)."""
    if isinstance(parsed, LineError):
        return parsed
    custom_id, req = parsed
    if custom_id in run.refused_ids or custom_id in line_of:
        return duplicate_error(number, custom_id)
    if run.has_images and (missing := resolve_paths(session, run.batch_id, run.images_root, req, number,
                                                    custom_id)):
        return missing
    try:
        resolve_model(None if deps.any_model else req.model, run.model_settings)
        return custom_id, normalize_request(req, session, deps.store, deps.settings, images, pack=run.pack,
                                              tenant=run.tenant, model_files=run.model_files)
    except SubmissionError as exc:
        return LineError(number, custom_id, exc.code, f"line {number}: {exc}", exc.param)


def _insert_jobs(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """The ids actually written: a row whose (batch_id, custom_id) exists already is skipped."""
    return batches.insert_ignoring_conflicts(session, Job, rows, ["batch_id", "custom_id"], returning=Job.id)


def _refused_ids(session: Session, batch_id: str) -> set[str]:
    stmt = select(BatchLineError.custom_id).where(BatchLineError.batch_id == batch_id,
                                                  BatchLineError.custom_id.is_not(None))
    return {cid for cid in session.scalars(stmt) if cid}


def _top_up(deps: IngestDeps, run: _Run) -> None:
    def send(model: str, job_ids: list[str], priority: int) -> None:
        deps.dispatch(run.model_settings, job_ids, priority)

    dispatch.top_up(deps.db, run.tenant, run.model_settings.served_model_name, deps.settings.dispatch_window, send)


def _fail(deps: IngestDeps, batch_id: str, code: str, message: str) -> str:
    with deps.db.session() as session:
        batches.fail(session, batch_id, [{"code": code, "line": None, "message": message, "param": None}])
        return _status(session, batch_id)


def _conclude(deps: IngestDeps, batch_id: str) -> str:
    """Every line is read: in_progress when some line became a job, failed when none did."""
    with deps.db.session() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        if batch.status != BatchStatus.VALIDATING:
            return batch.status
        if batch.total_requests == 0:
            batches.fail(session, batch_id, [{"code": "empty_file", "line": None, "param": None,
                                              "message": "the input file has no requests"}])
        elif batch.total_requests == batch.refused_requests:
            listed = session.scalars(
                select(BatchLineError).where(BatchLineError.batch_id == batch_id)
                .order_by(BatchLineError.line).limit(MAX_LISTED_ERRORS)
            )
            errors = [LineError(e.line, e.custom_id, e.code, e.message, e.param).as_batch_error() for e in listed]
            if batch.refused_requests > MAX_LISTED_ERRORS:
                errors.append({"code": "too_many_errors", "line": None, "param": None,
                               "message": f"{batch.refused_requests - MAX_LISTED_ERRORS} more lines were refused"})
            batches.fail(session, batch_id, errors)
        else:
            batches.start(session, batch_id)
        return _status(session, batch_id)


def _status(session: Session, batch_id: str) -> str:
    return session.scalar(select(Batch.status).where(Batch.id == batch_id)) or "missing"
