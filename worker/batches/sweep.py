"""The maintenance sweep (sweep_batches, sent by `vlmq beat` or the embedded worker's sweeper): what no job's
end catches. No Celery here: the task hands in how to send.

It requeues jobs whose worker died, marks unsent the jobs and ingestions whose messages the broker lost, tops
up every tenant's dispatch window, expires batches past their window, finalizes those a trigger missed, and
deletes expired files. Every step is safe to run twice or beside another sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from common.broker import dispatch
from common.broker.messages import BrokerNotInspectable, live_ingested_batch_ids, live_job_ids
from common.domain import batches, jobs
from common.domain.file_expiry import delete_expired_files
from common.domain.models import JobStatus, utcnow
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from worker.batches.finalize import due_batches, expire_batch, expire_due

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepDeps:
    settings: Settings
    db: Database
    store: ObjectStore
    send_jobs: dispatch.Send  # run_job messages to the queue of a model
    send_ingest: Callable[[str], None]  # ingest_batch for a batch id
    send_finalize: Callable[[str], None]  # finalize_batch for a batch id
    tell_workers: Callable[[], None] | None = None  # after running jobs were cancelled (finalize.TellWorkers)


def sweep(deps: SweepDeps) -> int:
    """One round of the sweep; returns the number of batches it sent to be finalized as a trigger missed."""
    with deps.db.session() as session:
        reaped = jobs.reap(session)
    if reaped[JobStatus.QUEUED] or reaped[JobStatus.DEAD]:
        log.info("reaped expired leases: %d requeued, %d dead", len(reaped[JobStatus.QUEUED]),
                 len(reaped[JobStatus.DEAD]))
    _republish_lost(deps)
    _resend_lost_ingestions(deps)
    dispatch.top_up_all(deps.db, deps.settings.dispatch_window, deps.send_jobs)
    for batch_id in expire_due(deps.db):
        cancelled = expire_batch(batch_id, deps.db, deps.tell_workers)
        log.info("batch %s expired: %d open jobs cancelled", batch_id, cancelled)
        # Its open jobs are cancelled now; a job that ended just before did so while some were still
        # queued, so no job's end may be left to send this.
        deps.send_finalize(batch_id)
    due = due_batches(deps.db)
    for batch_id in due:
        deps.send_finalize(batch_id)
    if deleted := delete_expired_files(deps.db, deps.store):
        log.info("deleted %d expired files", deleted)
    return len(due)


def _republish_lost(deps: SweepDeps) -> None:
    """Jobs whose message the broker lost (a Redis restart without persistence) are marked unsent, so the
    top-up that follows sends them again. SQL is the truth; the broker's contents are rebuilt from it."""
    settings = deps.settings
    try:
        live = live_job_ids(settings.broker_url, unacked_max_age=settings.republish_grace_seconds)
    except BrokerNotInspectable:
        return  # the in-process broker of embedded mode dies with its jobs' process, never alone
    except Exception:
        log.exception("could not list the broker's messages; republishing skipped this round")
        return
    lost = dispatch.lost_messages(deps.db, live, timedelta(seconds=settings.republish_grace_seconds))
    if lost:
        log.warning("%d queued jobs had no message in the broker; sending them again", len(lost))


def _resend_lost_ingestions(deps: SweepDeps) -> None:
    """Batches still validating whose ingest_batch message the broker lost (a Redis restart without
    persistence) get it again; they would otherwise wait, unread, until their completion window expired. A
    message sent twice is harmless: ingestion resumes after the last committed chunk, and two ingesters of
    one batch cannot both commit the same chunk (batches.advance_ingestion)."""
    try:
        live = live_ingested_batch_ids(deps.settings.broker_url)
    except BrokerNotInspectable:
        return  # embedded mode: `vlmq api` sends them again at start (worker/embedded.resume_ingestions)
    except Exception:
        log.exception("could not list the broker's messages; lost ingestions not looked for this round")
        return
    cutoff = utcnow() - timedelta(seconds=deps.settings.republish_grace_seconds)
    with deps.db.session() as session:
        lost = [b for b in batches.validating_since(session, cutoff) if b not in live]
    for batch_id in lost:
        log.warning("batch %s: its ingestion message was lost; sending it again", batch_id)
        deps.send_ingest(batch_id)
