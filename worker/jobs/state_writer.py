"""Group commit for a worker's claims and finishes: those asked for while one transaction is being written go
into the next one, as one UPDATE for the claims and one for the finishes (common.domain.jobs.claim_many /
finish_many).

A worker holds hundreds of jobs in flight and the engine ends many of them in the same step; per job, a claim
and a finish each cost a session, a connection checkout, a statement and a commit, all of it Python under the
GIL that the engine's thread is waiting for (bench/compare.py --profile: a quarter of the worker's samples on
tiny models). A group waits a few milliseconds after its first request for more (LINGER_SECONDS), so groups
grow with the load. If a group's transaction fails, its requests are written one by one, so one bad row (say,
text Postgres refuses) fails only its own job and the others' callers never see the error.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.infra.db import Database
from common.infra.group_commit import next_group

log = logging.getLogger(__name__)

# How long a group waits after its first request for others. Without it, the writer thread wakes for each
# request the moment it is queued and groups stay at one or two, while a claim costs far less CPU a job in a
# larger group (bench/compare.py, side by side); the wait is short beside the jobs it delays.
LINGER_SECONDS = 0.003


@dataclass
class _Request:
    job_id: str
    result: jobs.JobResult | None  # None: a claim
    answer: Future[Any] = field(default_factory=Future)


class StateWriter:
    def __init__(self, db: Database, worker_id: str, lease_seconds: float, max_group: int = 512,
                 linger_seconds: float = LINGER_SECONDS) -> None:
        # On Postgres, a connection of its own without the pool's ping: the ping is a round trip before every
        # transaction (as much CPU as a grouped claim), and this thread needs none. A connection
        # that died (Postgres restarted) fails its group, SQLAlchemy then drops it, and the group is written
        # again job by job on a new one; the callers retry what still fails.
        self._own_db = db.engine.dialect.name == "postgresql"
        self.db = Database(db.url, pre_ping=False, pool_size=1) if self._own_db else db
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.max_group = max_group
        self.linger_seconds = linger_seconds
        self.num_transactions = 0  # group transactions written (tests and metrics read it)
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        # Requests are queued under this lock, before `close` queues the stop: none can land after it and wait
        # forever for an answer.
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vlmq-state-writer", daemon=True)
        self._thread.start()

    def claim(self, job_id: str) -> ClaimedJob | None:
        """common.domain.jobs.claim(..., unless_last_try=True) of this one job, grouped with other threads' claims."""
        return self._ask(_Request(job_id, None))

    def claim_all(self, job_ids: list[str]) -> dict[str, ClaimedJob | Exception | None]:
        """`claim` of each job, asked for together so that they share a group: a chunk's claim. Each id maps to
        its claimed job, None (someone else holds it, it has ended, or this is its last try) or the error its
        claim met."""
        requests = [_Request(job_id, None) for job_id in dict.fromkeys(job_ids)]
        self._put(*requests)
        answers: dict[str, ClaimedJob | Exception | None] = {}
        for request in requests:
            error = request.answer.exception()
            answers[request.job_id] = error if isinstance(error, Exception) else request.answer.result()
        return answers

    def finish(self, job_id: str, result: jobs.JobResult) -> bool:
        """common.domain.jobs.finish of this one job, grouped with other threads' finishes."""
        return bool(self._ask(_Request(job_id, result)))

    def finish_later(self, job_id: str, result: jobs.JobResult) -> Future[bool]:
        """`finish` without waiting: the future answers whether the job was finished, on the writer's thread
        (callbacks added to it run there, so they must not block)."""
        request = _Request(job_id, result)
        self._put(request)
        return request.answer

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._own_db:
            self.db.dispose()

    def _ask(self, request: _Request) -> Any:
        self._put(request)
        return request.answer.result()

    def _put(self, *requests: _Request) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("state writer is closed")
            for request in requests:
                self._queue.put(request)

    def _run(self) -> None:
        while (group := next_group(self._queue, self.max_group, self.linger_seconds)) is not None:
            try:
                self._write(group)
            except Exception:  # never let one group stop the writer: every later request would hang
                log.exception("state writer: a group of %d failed", len(group))
                for request in group:
                    if not request.answer.done():
                        request.answer.set_exception(RuntimeError("state writer failed"))

    def _write(self, group: list[_Request]) -> None:
        claims = [r for r in group if r.result is None]
        finishes = {r.job_id: r.result for r in group if r.result is not None}
        try:
            # A plain connection: the grouped statements are Core, and a session's bookkeeping is CPU for nothing.
            with self.db.engine.begin() as connection:
                claimed = jobs.claim_many(connection, sorted({r.job_id for r in claims}), self.worker_id,
                                          self.lease_seconds)
                finished = jobs.finish_many(connection, self.worker_id, finishes)
            self.num_transactions += 1
        except Exception:
            if len(group) == 1:
                _answer(group[0], self._write_one)
                return
            log.warning("state writer: a group of %d failed; writing them one by one", len(group), exc_info=True)
            for request in group:
                _answer(request, self._write_one)
            return
        # Two deliveries of the same job in one group: the claim went to one of them only.
        taken: set[str] = set()
        for request in claims:
            job = claimed.get(request.job_id) if request.job_id not in taken else None
            taken.add(request.job_id)
            request.answer.set_result(job)
        for request in group:
            if request.result is not None:
                request.answer.set_result(request.job_id in finished)

    def _write_one(self, request: _Request) -> Any:
        with self.db.session() as session:
            self.num_transactions += 1
            if request.result is None:
                job = jobs.claim(session, request.job_id, self.worker_id, self.lease_seconds, unless_last_try=True)
                return None if job is None else ClaimedJob.of(job)
            return jobs.finish(session, request.job_id, self.worker_id, request.result)


def _answer(request: _Request, write: Any) -> None:
    """Run `write(request)` and hand its result, or its error, to the request's caller."""
    try:
        request.answer.set_result(write(request))
    except Exception as exc:
        request.answer.set_exception(exc)
