"""`vlmq run`: an OpenAI batch input file in, an OpenAI batch output file out, on embedded parts.

Each valid line becomes a job through the same submission code, queue, state machine and worker pipeline as
the service; a bad line becomes an error line in the output, never a failed run.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import func, select

from common.batch_input import LineError, iter_lines, job_line, parse_line, refused_line
from common.db import get_database
from common.migrate import upgrade
from common.models import TERMINAL_STATUSES, Job, JobStatus, new_id
from common.queue import make_celery, send_run_job
from common.settings import Settings
from common.storage import make_store
from common.submission import SubmissionError, submit_job
from worker.embedded import embedded_worker


@dataclass
class RunSummary:
    batch_id: str
    total_lines: int = 0
    submitted: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    line_errors: list[LineError] = field(default_factory=list)
    elapsed_s: float = 0.0
    completion_tokens: int = 0


def _lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, str | LineError]]:
    with path.open("rb") as f:
        yield from iter_lines(iter(lambda: f.read(1 << 20), b""), max_line_bytes)


def run_file(input_path: Path, output_path: Path, settings: Settings, console: Console | None = None) -> RunSummary:
    console = console or Console(stderr=True)
    upgrade(settings.database_url)
    db = get_database(settings.database_url)
    store = make_store(settings)
    app = make_celery(settings)
    summary = RunSummary(batch_id=new_id("run"))
    order: list[tuple[str, str | None]] = []  # (kind, key): ("job", custom_id) or ("error", index)
    with embedded_worker(app, settings):
        started = time.monotonic()  # throughput counts the jobs, not the model load
        seen: set[str] = set()
        for number, raw in _lines(input_path, settings.max_body_bytes):
            summary.total_lines += 1
            parsed = raw if isinstance(raw, LineError) else parse_line(number, raw, seen)
            if isinstance(parsed, LineError):
                summary.line_errors.append(parsed)
                order.append(("error", str(len(summary.line_errors) - 1)))
                continue
            custom_id, req = parsed
            req.model = None  # the file was written for some model; `vlmq run --model` decides which runs it
            try:
                with db.session() as session:
                    job, _ = submit_job(session, store, settings, req, batch_id=summary.batch_id,
                                        custom_id=custom_id)
                    job_id, priority = job.id, job.priority
            except SubmissionError as exc:
                summary.line_errors.append(LineError(number, custom_id, exc.code, str(exc)))
                order.append(("error", str(len(summary.line_errors) - 1)))
                continue
            send_run_job(app, settings, job_id, priority)
            summary.submitted += 1
            order.append(("job", custom_id))
        _wait(db, summary, console)
    summary.elapsed_s = time.monotonic() - started
    _write_output(db, store, summary, order, output_path)
    return summary


def _wait(db: Any, summary: RunSummary, console: Console) -> None:
    columns = (TextColumn("[bold]vlmq run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("jobs", total=summary.submitted, detail="")
        while True:
            with db.session() as session:
                rows = session.execute(
                    select(Job.status, func.count()).where(Job.batch_id == summary.batch_id).group_by(Job.status)
                ).all()
            counts = Counter({status: n for status, n in rows})
            done = sum(n for s, n in counts.items() if s in TERMINAL_STATUSES)
            detail = " ".join(f"{s}={counts[s]}" for s in sorted(counts))
            progress.update(task, completed=done, detail=detail)
            if done >= summary.submitted:
                summary.counts = counts
                return
            time.sleep(0.2)


def _write_output(db: Any, store: Any, summary: RunSummary, order: list[tuple[str, str | None]], path: Path) -> None:
    with db.session() as session:
        by_custom_id = {
            j.custom_id: j for j in session.scalars(select(Job).where(Job.batch_id == summary.batch_id))
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    with tmp.open("w", encoding="utf-8") as out:
        for kind, key in order:
            if kind == "error":
                err = summary.line_errors[int(key or 0)]
                line = refused_line(err, f"batch_req_line{err.line}")
            else:
                line = _job_line(by_custom_id[key], store)
                if line["response"] is not None:
                    summary.completion_tokens += line["response"]["body"]["usage"]["completion_tokens"]
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _job_line(job: Job, store: Any) -> dict[str, Any]:
    body = None
    if job.status == JobStatus.SUCCEEDED and job.result_key:
        try:
            body = json.loads(store.get(job.result_key))
        except Exception:
            body = None  # rebuilt from the row
    return job_line(job, body)
