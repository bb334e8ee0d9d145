"""Fair dispatch: SQL holds every queued job, the broker only a window of each tenant's.

A batch's rows are written `queued` but unsent (`dispatched_at` NULL). For each (tenant, model), at most
`dispatch_window` jobs are sent-and-unfinished at a time; as they finish, the window is topped up with that
tenant's next jobs. So a tenant with a million rows queued holds a window of the model's queue, and another
tenant's batch arriving later gets its own window at once: workers alternate between them instead of draining
the first million. Jobs from POST /v1/jobs are sent as they are written (they outrank batch jobs by priority)
and count against the same window.

Torch- and Celery-free: the caller passes `send`, which delivers run_job messages for one model's jobs.
Sending happens inside the transaction that marks the rows, before its commit: a failed send rolls the marks
back, so a job is never marked sent without a message (a send that succeeded before a failed commit only
leaves a duplicate message, which the claim drops). Rows being topped up are locked (SKIP LOCKED on
Postgres), so two concurrent top-ups never send the same job.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from common.domain.models import Job, JobStatus, utcnow
from common.infra.db import Database, rowcount

log = logging.getLogger(__name__)

# (model, job ids, priority) -> run_job messages on that model's queue.
Send = Callable[[str, list[str], int], object]


def refill_threshold(window: int) -> int:
    """Top up only once this many slots are free: one query per job end would be wasted on a 1-slot refill
    of a large window."""
    return max(1, window // 16)


def in_flight(session: Session, tenant: str, model: str) -> int:
    """The tenant's jobs of this model that were sent and have not ended (in the broker or running)."""
    stmt = select(func.count()).select_from(Job).where(
        Job.tenant == tenant, Job.model == model, Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)),
        Job.dispatched_at.is_not(None),
    )
    return int(session.scalar(stmt) or 0)


def top_up(db: Database, tenant: str, model: str, window: int, send: Send, *, min_room: int = 1) -> int:
    """Send the tenant's next unsent jobs of `model` until `window` are in flight; returns how many were sent.
    Does nothing while fewer than `min_room` slots are free."""
    with db.session() as session:
        room = window - in_flight(session, tenant, model)
        if room < min_room:
            return 0
        stmt = (
            select(Job.id, Job.priority)
            .where(Job.tenant == tenant, Job.model == model, Job.status == JobStatus.QUEUED,
                   Job.dispatched_at.is_(None))
            .order_by(Job.id)  # oldest first: the index's order, so no sort over a million rows
            .limit(room)
            .with_for_update(skip_locked=True)
        )
        by_priority: dict[int, list[str]] = defaultdict(list)
        for job_id, priority in session.execute(stmt):
            by_priority[priority].append(job_id)
        if not by_priority:
            return 0
        ids = [job_id for group in by_priority.values() for job_id in group]
        session.execute(
            update(Job).where(Job.id.in_(ids), Job.status == JobStatus.QUEUED, Job.dispatched_at.is_(None))
            .values(dispatched_at=utcnow()).execution_options(synchronize_session=False)
        )
        for priority in sorted(by_priority, reverse=True):
            send(model, by_priority[priority], priority)
        return len(ids)


def top_up_after_job(db: Database, tenant: str, model: str, window: int, send: Send) -> int:
    """After one of the tenant's jobs of `model` ended: refill the window, if enough of it is free."""
    return top_up(db, tenant, model, window, send, min_room=refill_threshold(window))


def waiting_pairs(session: Session) -> list[tuple[str, str]]:
    """(tenant, model) pairs with unsent queued jobs: what a periodic sweep tops up."""
    stmt = select(Job.tenant, Job.model).where(Job.status == JobStatus.QUEUED,
                                               Job.dispatched_at.is_(None)).distinct()
    return [(tenant, model) for tenant, model in session.execute(stmt)]


def top_up_all(db: Database, window: int, send: Send) -> int:
    """Every tenant's window, for every model (the sweep: covers triggers that never came)."""
    with db.session() as session:
        pairs = waiting_pairs(session)
    sent = 0
    for tenant, model in pairs:
        try:
            sent += top_up(db, tenant, model, window, send)
        except Exception:
            log.exception("dispatch of tenant %s's %s jobs failed", tenant, model)
    return sent


def lost_messages(db: Database, live_ids: set[str], grace: timedelta) -> list[str]:
    """Republisher: queued jobs marked sent more than `grace` ago whose message the broker no longer holds
    (`live_ids`) are marked unsent again, for the next top-up to send. A message in flight between the
    broker's lists at the moment of looking only earns a duplicate, which the claim drops; a lost one would
    leave its job queued forever, so the check errs towards sending."""
    cutoff = utcnow() - grace
    with db.session() as session:
        # Sent-and-queued jobs are bounded by the dispatch windows, so they are few enough to hold.
        sent = session.scalars(select(Job.id).where(Job.status == JobStatus.QUEUED, Job.dispatched_at < cutoff))
        lost = [job_id for job_id in sent if job_id not in live_ids]
        for start in range(0, len(lost), 1000):
            mark_unsent(session, lost[start:start + 1000])
    return lost


def send_or_mark_unsent(db: Database, job_ids: list[str], send: Callable[[], object]) -> bool:
    """`send()` the run_job messages of jobs already committed `queued`; where it fails, mark them unsent, and
    the next top-up (the sweep's, if no job end asks sooner) sends them. Returns whether the send went through."""
    try:
        send()
        return True
    except Exception:
        log.exception("could not dispatch %d jobs", len(job_ids))
    try:
        with db.session() as session:
            mark_unsent(session, job_ids)
    except Exception:  # still queued in SQL: the republisher finds them once their grace has passed
        log.exception("could not mark %d jobs unsent", len(job_ids))
    return False


def mark_unsent(session: Session, job_ids: list[str]) -> int:
    """Their messages never reached the broker (or were lost): the next top-up sends them again."""
    stmt = (
        update(Job).where(and_(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED))
        .values(dispatched_at=None).execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt)
