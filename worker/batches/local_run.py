"""`vlmq run`: an OpenAI batch input file in, an OpenAI batch output file out, on embedded parts.

The file goes the way of any batch: it is stored as a file, a batch is created for it, worker/batches/ingest.py checks
and ingests it (bad lines become error lines, never a failed run), the jobs run through the queue, state
machine and worker pipeline of the service, and worker/batches/finalize.py ends the batch. Only the broker and the
worker live in this process. The output keeps the input's line order: results, then refusals, line by line.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import func, select

from common.broker.dispatch import top_up
from common.broker.queue import make_celery, send_run_jobs
from common.domain import batches
from common.domain.batch_input import JOB_LINE_COLUMNS, LineError, iter_lines, job_line, refused_line
from common.domain.files import add_file, discard_files, file_key, open_reader, open_writer
from common.domain.models import (
    BATCH_FINAL_STATUSES,
    DEFAULT_TENANT,
    TERMINAL_STATUSES,
    Batch,
    BatchLineError,
    BatchStatus,
    FileRecord,
    Job,
    new_file_id,
)
from common.images.archive import images_archive
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.batches.input_check import UnrunnableInput, at_most_lines, unrunnable_input
from worker.embedded import embedded_worker, load_in_background

COPY_CHUNK_BYTES = 1 << 20
ROWS_PER_READ = 1000
# Up to this many lines, the engine runs in this process rather than a child of its own: the child keeps the
# engine's Python off the GIL that feeds it, which pays on a long run, but it imports torch and loads the model
# a second time before its first step, which a short run waits for and never earns back (bench/run_startup.py).
IN_PROCESS_ENGINE_LINES = 1000
PROGRESS_SECONDS = 0.2
_RESUMABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)


@dataclass
class RunSummary:
    batch_id: str = ""
    status: str = ""  # the batch's at the end: completed, or failed (nothing in the file could run) with `errors`
    errors: list[dict[str, Any]] = field(default_factory=list)
    total_lines: int = 0
    submitted: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    line_errors: list[LineError] = field(default_factory=list)
    elapsed_s: float = 0.0
    # Of elapsed_s, the seconds before the model was loaded (it loads while the input is stored and checked).
    loading_s: float = 0.0
    completion_tokens: int = 0
    # Jobs whose input line carried an expected answer (metadata.answer), and how many were answered so.
    expected: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.expected if self.expected else None


def _store_file(db: Database, store: ObjectStore, path: Path, purpose: str = "batch") -> tuple[str, str]:
    """The local file as a vlmq file (streamed into the object store), as POST /v1/files would keep it; (its
    id, the sha256 of its bytes). Read once, so the input may be a pipe."""
    file_id = new_file_id()
    digest = hashlib.sha256()
    writer = open_writer(store, file_key(file_id, DEFAULT_TENANT))
    try:
        with path.open("rb") as f:
            while chunk := f.read(COPY_CHUNK_BYTES):
                digest.update(chunk)
                writer.write(chunk)
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    with db.session() as session:
        add_file(session, file_id=file_id, key=file_key(file_id, DEFAULT_TENANT), size=size, filename=path.name,
                 purpose=purpose, tenant=DEFAULT_TENANT)
    return file_id, digest.hexdigest()


def check_output_path(input_path: Path, output_path: Path) -> None:
    """Refuse an output path that cannot be written before any work is done (ValueError), not after it."""
    if output_path.exists() and output_path.is_dir():
        raise ValueError(f"{output_path} is a directory; give the output file's path")
    if output_path.exists() and input_path.exists() and output_path.samefile(input_path):
        raise ValueError(f"{output_path} is the input file; the output would replace it")
    probe = output_path.with_suffix(output_path.suffix + ".partial")
    try:
        output_path.parent.mkdir(parents=True, exist_ok=True)
        probe.open("a").close()
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"cannot write the output next to {output_path}: {exc.strerror or exc}") from None


def _unfinished_batch(db: Database, settings: Settings, fingerprint: dict[str, str]) -> str | None:
    """The newest batch an interrupted `vlmq run` left for the same input, images and model, if any."""
    with db.session() as session:
        candidates = session.scalars(
            select(Batch).where(Batch.tenant == DEFAULT_TENANT, Batch.model == settings.served_model_name,
                                Batch.status.in_(_RESUMABLE)).order_by(Batch.created_at.desc())).all()
        return next((b.id for b in candidates if (b.metadata_ or {}) == fingerprint), None)


def _start_batch(db: Database, store: ObjectStore, settings: Settings, input_path: Path, images: Path | None,
                 console: Console) -> tuple[str, bool]:
    """(batch id, resumed): a new batch for the file, or the one an interrupted run of it left behind."""
    input_id, input_sha = _store_file(db, store, input_path)
    images_id, images_sha = None, ""
    with images_archive(images) if images is not None else nullcontext() as archive:
        if archive is not None:
            images_id, images_sha = _store_file(db, store, archive)
    fingerprint = {"source": "vlmq run", "input_sha256": input_sha, "images_sha256": images_sha}
    if (earlier := _unfinished_batch(db, settings, fingerprint)) is not None:
        discard_files(db, store, DEFAULT_TENANT, [f for f in (input_id, images_id) if f is not None])
        console.print(f"resuming {earlier}, which an interrupted run of this file left; its finished requests "
                      "are kept")
        return earlier, True
    with db.session() as session:
        batch = batches.create_batch(
            session, input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
            model=settings.served_model_name, metadata=fingerprint, images_file_id=images_id)
        return batch.id, False


def run_file(input_path: Path, output_path: Path, settings: Settings, console: Console | None = None,
             images: Path | None = None, on_model_loaded: Callable[[], object] | None = None) -> RunSummary:
    """`on_model_loaded`: called once the model is loaded, while the run goes on (the CLI freezes its heap)."""
    console = console or Console(stderr=True)
    check_output_path(input_path, output_path)
    if (unrunnable := unrunnable_input(input_path, settings)) is not None:
        return _refuse_file(unrunnable, output_path)
    settings = run_settings(settings, input_path)
    # The model loads while the database is readied and the input stored, checked and queued; jobs wait for it.
    model_loaded = load_in_background(settings, then=on_model_loaded)
    upgrade(settings.database_url)
    db = get_database(settings.database_url)
    store = make_store(settings)
    app = make_celery(settings)
    summary = RunSummary()
    with embedded_worker(app, settings, model_loaded=model_loaded):
        started = time.monotonic()  # throughput counts the jobs, not the imports
        loaded_at: list[float] = []
        model_loaded.add_done_callback(lambda _: loaded_at.append(time.monotonic()))
        summary.batch_id, _ = _start_batch(db, store, settings, input_path, images, console)

        def dispatch(model_settings: Settings, job_ids: list[str], priority: int) -> None:
            send_run_jobs(app, model_settings, job_ids, priority)

        deps = IngestDeps(settings, db, store, dispatch, any_model=True)
        with console.status("checking and queueing the input lines"):
            ingest_batch(summary.batch_id, deps)  # a resumed batch's ingestion goes on after its last chunk
        # What an interrupted run had queued but not sent (ingestion tops up only while it reads lines).
        top_up(db, DEFAULT_TENANT, settings.served_model_name, settings.dispatch_window,
               lambda _model, ids, priority: dispatch(settings, ids, priority))
        _wait(db, app, settings, summary, console, model_loaded)
        summary.elapsed_s = time.monotonic() - started
        summary.loading_s = max(0.0, min(loaded_at or [started]) - started)
    _write_output(db, summary, output_path, _expected_answers(db, store, settings, summary.batch_id))
    return summary


def run_settings(settings: Settings, input_path: Path) -> Settings:
    """The settings for a run of this file: a short one runs the engine in this process, unless told where."""
    if "engine_process" not in settings.model_fields_set and at_most_lines(input_path, IN_PROCESS_ENGINE_LINES):
        return settings.model_copy(update={"engine_process": False})
    return settings


def _refuse_file(unrunnable: UnrunnableInput, path: Path) -> RunSummary:
    """A file nothing of which can run: its refused lines written as ingestion would have had them written."""
    summary = RunSummary(status="failed", errors=unrunnable.errors, line_errors=unrunnable.line_errors,
                         total_lines=len(unrunnable.line_errors))
    tmp = path.with_suffix(path.suffix + ".partial")
    with tmp.open("w", encoding="utf-8") as out:
        for error in unrunnable.line_errors:
            out.write(json.dumps(refused_line(error, f"batch_req_line{error.line}"), ensure_ascii=False) + "\n")
    tmp.replace(path)
    return summary


def _expected_answers(db: Database, store: ObjectStore, settings: Settings, batch_id: str) -> dict[str, str]:
    """custom_id -> the answer a line expects, from lines that carry one (`"metadata": {"answer": ...}` beside
    the request, as examples/shapes.jsonl does); read back from the stored input (which may have been a pipe),
    the first line of a custom_id counting, as ingestion does. Lines that are not JSON are skipped."""
    with db.session() as session:
        batch = session.get(Batch, batch_id)
        record = session.get(FileRecord, batch.input_file_id) if batch is not None else None
        if record is None:
            return {}
        key = record.object_key
    expected: dict[str, str] = {}
    for _, raw in iter_lines(open_reader(store, key), settings.max_body_bytes):
        if isinstance(raw, LineError):
            continue
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):  # the line's error is in the error file already
            continue
        metadata = line.get("metadata") if isinstance(line, dict) else None
        if isinstance(metadata, dict) and isinstance(metadata.get("answer"), str):
            expected.setdefault(str(line.get("custom_id")), metadata["answer"])
    return expected


def _wait(db: Database, app: Any, settings: Settings, summary: RunSummary, console: Console,
          model_loaded: Future[None]) -> None:
    """Show the run's progress until its batch ends. The counts are SQL's once, at the start (a resumed run's
    finished jobs), then this process's worker's own as its jobs end (after_job.ended_jobs): counting the batch's
    rows in SQL at every refresh would take the GIL and the database from the worker it waits for."""
    from common.broker.queue import send_finalize_batch
    from worker.jobs.after_job import ended_jobs

    columns = (TextColumn("[bold]vlmq run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with db.session() as session:
        batch = session.get(Batch, summary.batch_id)
        assert batch is not None
        summary.total_lines = batch.total_requests
        summary.submitted = batch.total_requests - batch.refused_requests
        ended_jobs.watch(summary.batch_id)  # counted from here on; SQL's count so far, once
        counts_before = Counter({s: n for s, n in _job_counts(session, summary.batch_id).items()
                                 if s in TERMINAL_STATUSES})
    send_finalize_batch(app, settings, summary.batch_id)  # it may have ended while lines were still being read
    try:
        _show_progress(db, summary, columns, console, model_loaded, counts_before)
    finally:
        ended_jobs.unwatch(summary.batch_id)


def _show_progress(db: Database, summary: RunSummary, columns: tuple[Any, ...], console: Console,
                   model_loaded: Future[None], counts_before: Counter[str]) -> None:
    from worker.batches.finalize import wait_for_a_batch_end
    from worker.jobs.after_job import ended_jobs

    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("jobs", total=summary.submitted, detail="")
        while True:
            with db.session() as session:
                status = session.scalar(select(Batch.status).where(Batch.id == summary.batch_id))
                final = status in BATCH_FINAL_STATUSES
                counts = (_job_counts(session, summary.batch_id) if final
                          else counts_before + ended_jobs.of(summary.batch_id))
            done = sum(n for s, n in counts.items() if s in TERMINAL_STATUSES)
            progress.update(task, completed=done, detail=" ".join(f"{s}={counts[s]}" for s in sorted(counts)))
            if status is not None and final:
                summary.counts, summary.status = counts, status
                with db.session() as session:
                    batch = session.get(Batch, summary.batch_id)
                    summary.errors = list(batch.errors or []) if batch is not None else []
                return
            if model_loaded.done():
                model_loaded.result()  # a model that could not load ends the run with its error
            wait_for_a_batch_end(PROGRESS_SECONDS)


def _job_counts(session: Any, batch_id: str) -> Counter[str]:
    rows = session.execute(select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status))
    return Counter({status: n for status, n in rows})


def _write_output(db: Database, summary: RunSummary, path: Path,
                  expected: dict[str, str]) -> None:
    """Every input line's outcome in input order: a merge of the jobs and the refused lines by line number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    with db.session() as session, tmp.open("w", encoding="utf-8") as out:
        refused = iter(session.scalars(select(BatchLineError).where(BatchLineError.batch_id == summary.batch_id)
                                       .order_by(BatchLineError.line)).all())
        pending = next(refused, None)
        jobs = session.execute(select(*JOB_LINE_COLUMNS).where(Job.batch_id == summary.batch_id)
                               .order_by(Job.line).execution_options(yield_per=ROWS_PER_READ))
        for job in jobs:
            while pending is not None and pending.line < (job.line or 0):
                pending = _write_refused(out, summary, pending, refused)
            line = job_line(job)
            answer = None
            if line["response"] is not None and line["error"] is None:
                summary.completion_tokens += line["response"]["body"]["usage"]["completion_tokens"]
                answer = line["response"]["body"]["choices"][0]["message"]["content"]
            _score(summary, expected.get(job.custom_id or ""), answer)
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
        while pending is not None:
            pending = _write_refused(out, summary, pending, refused)
    tmp.replace(path)


def _normal(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".!")


def _score(summary: RunSummary, expected: str | None, answer: str | None) -> None:
    """Exact match up to case, spacing and a final full stop; a job that gave no answer counts as wrong."""
    if expected is None:
        return
    summary.expected += 1
    summary.correct += answer is not None and _normal(answer) == _normal(expected)


def _write_refused(out: Any, summary: RunSummary, err: BatchLineError, rest: Any) -> BatchLineError | None:
    error = LineError(err.line, err.custom_id, err.code, err.message)
    summary.line_errors.append(error)
    out.write(json.dumps(refused_line(error, f"batch_req_line{err.line}"), ensure_ascii=False) + "\n")
    return next(rest, None)
