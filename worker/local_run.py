"""`vlmq run`: an OpenAI batch input file in, an OpenAI batch output file out, on embedded parts.

The file goes the way of any batch: it is stored as a file, a batch is created for it, worker/ingest.py checks
and ingests it (bad lines become error lines, never a failed run), the jobs run through the queue, state
machine and worker pipeline of the service, and worker/finalize.py ends the batch. Only the broker and the
worker live in this process. The output keeps the input's line order: results, then refusals, line by line.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import func, select

from common import batches
from common.batch_cli import images_archive
from common.batch_input import LineError, job_line, refused_line
from common.db import Database, get_database
from common.files import add_file, file_key, open_writer
from common.migrate import upgrade
from common.models import (
    BATCH_FINAL_STATUSES,
    DEFAULT_TENANT,
    TERMINAL_STATUSES,
    Batch,
    BatchLineError,
    Job,
    new_file_id,
)
from common.queue import make_celery, send_run_jobs
from common.settings import Settings
from common.storage import ObjectStore, make_store
from worker.embedded import embedded_worker
from worker.ingest import IngestDeps, ingest_batch

COPY_CHUNK_BYTES = 1 << 20
ROWS_PER_READ = 1000


@dataclass
class RunSummary:
    batch_id: str = ""
    total_lines: int = 0
    submitted: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    line_errors: list[LineError] = field(default_factory=list)
    elapsed_s: float = 0.0
    completion_tokens: int = 0
    # Jobs whose input line carried an expected answer (metadata.answer), and how many were answered so.
    expected: int = 0
    correct: int = 0

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.expected if self.expected else None


def _store_file(db: Database, store: ObjectStore, path: Path, purpose: str = "batch") -> str:
    """The local file as a vlmq file (streamed into the object store), as POST /v1/files would keep it."""
    file_id = new_file_id()
    writer = open_writer(store, file_key(file_id, DEFAULT_TENANT))
    try:
        with path.open("rb") as f:
            while chunk := f.read(COPY_CHUNK_BYTES):
                writer.write(chunk)
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    with db.session() as session:
        add_file(session, file_id=file_id, key=file_key(file_id, DEFAULT_TENANT), size=size, filename=path.name,
                 purpose=purpose, tenant=DEFAULT_TENANT)
    return file_id


def run_file(input_path: Path, output_path: Path, settings: Settings, console: Console | None = None,
             images: Path | None = None) -> RunSummary:
    console = console or Console(stderr=True)
    upgrade(settings.database_url)
    db = get_database(settings.database_url)
    store = make_store(settings)
    app = make_celery(settings)
    summary = RunSummary()
    with embedded_worker(app, settings):
        started = time.monotonic()  # throughput counts the jobs, not the model load
        input_id = _store_file(db, store, input_path)
        with images_archive(images) if images is not None else nullcontext() as archive:
            images_id = _store_file(db, store, archive) if archive is not None else None
        with db.session() as session:
            summary.batch_id = batches.create_batch(
                session, input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
                model=settings.served_model_name, metadata={"source": "vlmq run"}, images_file_id=images_id).id

        def dispatch(model_settings: Settings, job_ids: list[str], priority: int) -> None:
            send_run_jobs(app, model_settings, job_ids, priority)

        with console.status("checking and queueing the input lines"):
            ingest_batch(summary.batch_id, IngestDeps(settings, db, store, dispatch, any_model=True))
        _wait(db, app, settings, summary, console)
        summary.elapsed_s = time.monotonic() - started
    _write_output(db, summary, output_path, _expected_answers(input_path))
    return summary


def _expected_answers(path: Path) -> dict[str, str]:
    """custom_id -> the answer a line expects, from lines that carry one (`"metadata": {"answer": ...}` beside
    the request, as examples/shapes.jsonl does); lines that do not, or are not JSON, are skipped."""
    expected: dict[str, str] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for raw in f:
            try:
                line = json.loads(raw)
            except (ValueError, RecursionError):  # the line's error is in the error file already
                continue
            metadata = line.get("metadata") if isinstance(line, dict) else None
            if isinstance(metadata, dict) and isinstance(metadata.get("answer"), str):
                expected[str(line.get("custom_id"))] = metadata["answer"]
    return expected


def _wait(db: Database, app: Any, settings: Settings, summary: RunSummary, console: Console) -> None:
    from common.queue import send_finalize_batch

    columns = (TextColumn("[bold]vlmq run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with db.session() as session:
        batch = session.get(Batch, summary.batch_id)
        assert batch is not None
        summary.total_lines = batch.total_requests
        summary.submitted = batch.total_requests - batch.refused_requests
    send_finalize_batch(app, settings, summary.batch_id)  # it may have ended while lines were still being read
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("jobs", total=summary.submitted, detail="")
        while True:
            with db.session() as session:
                rows = session.execute(select(Job.status, func.count()).where(Job.batch_id == summary.batch_id)
                                       .group_by(Job.status)).all()
                status = session.scalar(select(Batch.status).where(Batch.id == summary.batch_id))
            counts = Counter({s: n for s, n in rows})
            done = sum(n for s, n in counts.items() if s in TERMINAL_STATUSES)
            progress.update(task, completed=done, detail=" ".join(f"{s}={counts[s]}" for s in sorted(counts)))
            if status in BATCH_FINAL_STATUSES:
                summary.counts = counts
                return
            time.sleep(0.2)


def _write_output(db: Database, summary: RunSummary, path: Path,
                  expected: dict[str, str]) -> None:
    """Every input line's outcome in input order: a merge of the jobs and the refused lines by line number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    with db.session() as session, tmp.open("w", encoding="utf-8") as out:
        refused = iter(session.scalars(select(BatchLineError).where(BatchLineError.batch_id == summary.batch_id)
                                       .order_by(BatchLineError.line)).all())
        pending = next(refused, None)
        jobs = session.scalars(select(Job).where(Job.batch_id == summary.batch_id).order_by(Job.line)
                               .execution_options(yield_per=ROWS_PER_READ))
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
