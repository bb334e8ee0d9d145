"""Waiting for jobs to end, for the requests that answer only then (POST /v1/chat/completions).

One poller per API process reads, in one SQL query, every job it waits on that is due a look; a job is looked
at soon after its submission and then less and less often, so a short job is answered quickly and a long one
costs a primary-key lookup now and then, and requests waiting together share their queries. The poller runs
only while a request waits, and its queries run in the thread pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select

from common.domain.models import TERMINAL_STATUSES, Job
from common.infra.db import Database

log = logging.getLogger(__name__)

FIRST_LOOK_S = 0.02
LOOK_GROWTH = 1.5
MAX_LOOK_S = 0.5
_IDS_PER_QUERY = 500


@dataclass(frozen=True)
class EndedJob:
    id: str
    status: str
    model: str
    created_at: datetime
    result_text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error_code: str | None
    error_message: str | None


@dataclass
class _Waiting:
    futures: list[asyncio.Future[EndedJob]] = field(default_factory=list)
    due: float = 0.0
    gap: float = FIRST_LOOK_S


class JobWaiter:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._waiting: dict[str, _Waiting] = {}
        self._poller: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def wait(self, job_id: str) -> EndedJob:
        """The job once it has ended; cancel the call to stop waiting (the job itself is not touched)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EndedJob] = loop.create_future()
        waiting = self._waiting.get(job_id)
        if waiting is None:
            waiting = self._waiting[job_id] = _Waiting(due=time.monotonic() + FIRST_LOOK_S)
        waiting.futures.append(future)
        # A new poller, with an event of its own, also for an app served on another event loop than before.
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._poller = loop.create_task(self._poll(), name="vlmq-job-waiter")
        self._wake.set()
        try:
            return await future
        finally:
            current = self._waiting.get(job_id)
            if current is not None and future in current.futures:
                current.futures.remove(future)
                if not current.futures:
                    del self._waiting[job_id]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        self._waiting.clear()

    async def _poll(self) -> None:
        while self._waiting:
            now = time.monotonic()
            if not any(w.due <= now for w in self._waiting.values()):
                self._wake.clear()
                soonest = min(w.due for w in self._waiting.values())
                # A new waiter wakes the poller: its first look may be sooner than any due now.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, soonest - now))
                continue
            # Jobs due within half their gap are looked at now too, a little early: waiters that came at
            # different moments fall into step and share one query.
            due = [job_id for job_id, w in self._waiting.items() if w.due - w.gap / 2 <= now]
            try:
                ended = await run_in_threadpool(self._ended, due)
            except Exception as exc:  # the database blinked: the waiters wait on, up to their own limits
                log.warning("could not look up %d awaited jobs: %s", len(due), exc)
                ended = {}
            now = time.monotonic()
            for job_id in due:
                waiting = self._waiting.get(job_id)
                if waiting is None:
                    continue
                job = ended.get(job_id)
                if job is not None:
                    del self._waiting[job_id]
                    for future in waiting.futures:
                        if not future.done():
                            future.set_result(job)
                else:
                    waiting.gap = min(waiting.gap * LOOK_GROWTH, MAX_LOOK_S)
                    waiting.due = now + waiting.gap

    def _ended(self, job_ids: list[str]) -> dict[str, EndedJob]:
        ended: dict[str, EndedJob] = {}
        with self.db.session() as session:
            for start in range(0, len(job_ids), _IDS_PER_QUERY):
                rows = session.execute(select(
                    Job.id, Job.status, Job.model, Job.created_at, Job.result_text, Job.finish_reason,
                    Job.prompt_tokens, Job.completion_tokens, Job.error_code, Job.error_message,
                ).where(Job.id.in_(job_ids[start:start + _IDS_PER_QUERY]), Job.status.in_(TERMINAL_STATUSES)))
                for row in rows:
                    ended[row.id] = EndedJob(**row._mapping)
        return ended
