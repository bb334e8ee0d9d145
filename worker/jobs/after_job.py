"""What follows a job's end on its worker: refill the tenant's dispatch window, and send finalize_batch when
the job was the last open one of its batch. No Celery here: the run_job task hands in how to send.

Asked for right after each job ends, rather than left to the periodic sweep: a batch completes as soon as its
last job does, and its window is refilled while the engine still has work. Both run on one debouncer thread
per process (common/infra/debounce.py), at most every AFTER_JOB_INTERVAL_SECONDS per key, and once after the
last job to ask: each is one or two indexed queries that answer for every job ended before it started. The
finalize check after the last job of a batch this worker held runs at once, not after the interval: that is
when the batch is likely done. A job
that ends elsewhere (reaped to `dead`), or a run lost with its process, is caught by the sweep
(worker/batches/sweep.py). Finalization is idempotent, should two checks both see the batch done.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from common.broker import dispatch
from common.domain import batches
from common.domain.models import TERMINAL_STATUSES
from common.infra.db import Database
from common.infra.debounce import Debouncer
from worker.jobs.pipeline import Ending, Outcome

AFTER_JOB_INTERVAL_SECONDS = 0.1
# One thread for the process, whatever its apps: the keys name the database, so apps on two databases never
# share a run.
_after_job_work = Debouncer(AFTER_JOB_INTERVAL_SECONDS, name="vlmq-after-job")


@dataclass(frozen=True)
class AfterJobDeps:
    db: Database
    dispatch_window: int  # jobs of a tenant and model held in flight (VLMQ_DISPATCH_WINDOW)
    send_jobs: dispatch.Send  # run_job messages to the queue of a model
    send_finalize: Callable[[str], None]  # finalize_batch for a batch id


class EndedJobs:
    """How many jobs of each watched batch ended in this process, by status: `vlmq run` shows its progress from
    these rather than by counting its batch's rows in SQL while its worker writes them. Only watched batches
    are counted, so a long-lived worker keeps nothing per batch."""

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()

    def watch(self, batch_id: str) -> None:
        with self._lock:
            self._counts.setdefault(batch_id, Counter())

    def unwatch(self, batch_id: str) -> None:
        with self._lock:
            self._counts.pop(batch_id, None)

    def add(self, batch_id: str, status: str) -> None:
        with self._lock:
            if (counts := self._counts.get(batch_id)) is not None:
                counts[status] += 1

    def of(self, batch_id: str) -> Counter[str]:
        with self._lock:
            return Counter(self._counts.get(batch_id, ()))


ended_jobs = EndedJobs()


def has_follow_ups(outcome: Outcome) -> bool:
    """Whether the job ended on this worker: one to run again, or a duplicate delivery this worker skipped,
    has not, and nothing follows it (nor is anything built for it: a stand-in pipeline has no database)."""
    return not outcome.retry and outcome.status != Ending.SKIPPED


def after_job(deps: AfterJobDeps, job_id: str, outcome: Outcome) -> None:
    """Ask for the follow-ups of a job that ended on this worker (has_follow_ups)."""
    assert outcome.tenant is not None and outcome.model is not None  # a job that ran carries them
    tenant, model, db = outcome.tenant, outcome.model, deps.db
    _after_job_work.request(("top_up", id(db), tenant, model), lambda: dispatch.top_up_after_job(
        db, tenant, model, deps.dispatch_window, deps.send_jobs))
    if outcome.batch_id is None:
        return  # a single job: no batch to finalize
    if outcome.status in TERMINAL_STATUSES:
        ended_jobs.add(outcome.batch_id, outcome.status)

    def finalize_if_done() -> None:
        with db.session() as session:
            batch_id = batches.ready_after_job(session, job_id)
        if batch_id is not None:
            deps.send_finalize(batch_id)

    _after_job_work.request(("finalize", id(db), outcome.batch_id), finalize_if_done, now=outcome.batch_drained)
