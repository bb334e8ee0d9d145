"""Group commit for POST /v1/jobs: the jobs that arrive while one transaction is being written go into the
next one, with their run_job messages sent in one Redis round trip after its commit.

Per job, a commit costs a WAL flush and a round trip on the database, a session and a connection checkout on
our side, and a thread-pool hand-off per request: together a large share of a submission's CPU (bench/ingest.py).
Batching needs no timer: under load, requests pile up while a write is in progress, so batches grow with the
load and a lone request is written at once. A request's answer still comes only after its job is committed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from sqlalchemy.exc import InterfaceError, OperationalError

from api.deps import AppState
from common.broker import dispatch
from common.broker.queue import send_run_jobs
from common.domain import jobs
from common.domain.views import job_view
from common.infra.group_commit import next_group

log = logging.getLogger(__name__)

# The database itself is unreachable: writing the group's requests one by one would only fail them slower.
_UNREACHABLE = (OperationalError, InterfaceError)


@dataclass
class _Pending:
    fields: jobs.NewJob
    answer: Future[str]  # the job's JSON view, once committed


class JobWriter:
    def __init__(self, state: AppState, max_batch: int = 512) -> None:
        self.state = state
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def write(self, fields: jobs.NewJob) -> str:
        """Commit a new queued job and dispatch it; its JSON view."""
        self._ensure_started()
        answer: Future[str] = Future()
        self._queue.put(_Pending(fields, answer))
        return await asyncio.wrap_future(answer)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10)

    def _ensure_started(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="vlmq-job-writer", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while (batch := next_group(self._queue, self.max_batch)) is not None:
            # A request whose client went away before its turn is not written (it was never answered 202);
            # the others can no longer be cancelled, so their answers can always be set.
            batch = [p for p in batch if p.answer.set_running_or_notify_cancel()]
            try:
                if batch:
                    self._write(batch)
            except Exception:  # never let one batch stop the writer: every later request would hang
                log.exception("job writer: a batch of %d failed", len(batch))

    def _write(self, batch: list[_Pending]) -> None:
        try:
            with self.state.db.session() as session:
                made = [p.fields.job() for p in batch]
                session.add_all(made)
                session.flush()
                views = [(job.id, job.priority, job_view(job).model_dump_json()) for job in made]
        except BaseException as exc:
            if len(batch) > 1 and isinstance(exc, Exception) and not isinstance(exc, _UNREACHABLE):
                # One request's value the database refused (or a bug it alone meets) must not fail the
                # requests that happened to share its transaction: each is written on its own instead.
                log.warning("job writer: a group of %d failed (%s); writing them one by one", len(batch), exc)
                for p in batch:
                    self._write([p])
                return
            for p in batch:
                p.answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._send(views)
        for p, (_, _, view) in zip(batch, views, strict=True):
            p.answer.set_result(view)

    def _send(self, views: list[tuple[str, int, str]]) -> None:
        by_priority: dict[int, list[str]] = defaultdict(list)
        for job_id, priority, _ in views:
            by_priority[priority].append(job_id)
        for priority, job_ids in by_priority.items():
            dispatch.send_or_mark_unsent(self.state.db, job_ids, partial(
                send_run_jobs, self.state.celery, self.state.settings, job_ids, priority))
