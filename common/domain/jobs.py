"""The job state machine (docs/architecture.md). The only module that writes a job's status.

Every transition is one conditional UPDATE, so two workers, a reaper and a cancel can race freely: exactly one
of them changes the row, the others see rowcount 0 and step back.

    queued --claim--> running --finish--> succeeded
      ^                 |  '--fail--> failed          (input error: never retried)
      '--release/reap---'  '--attempts >= max--> dead  (poison job)
    queued|running --cancel--> cancelled
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Integer, String, Text, and_, any_, bindparam, column, func, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import BindParameter

from common.domain.claimed_job import CLAIMED_COLUMNS, ClaimedJob
from common.domain.models import DEFAULT_TENANT, Job, JobStatus, NulSafeText, UTCDateTime, new_id, utcnow
from common.infra.db import rowcount


@dataclass(frozen=True)
class JobResult:
    result_key: str | None  # None for a batch row: the row is its result, rendered on demand
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class NewJob:
    """What a job is made of, checked and normalised at submission (common.domain.submission.job_fields), on
    its way to its row; `dispatched`: the submitter sends its run_job message right after the commit."""

    model: str
    request: dict[str, Any]
    priority: int = 5
    max_attempts: int = 3
    metadata: dict[str, Any] | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    tenant: str = DEFAULT_TENANT
    dispatched: bool = True

    def job(self, idempotency_key: str | None = None) -> Job:
        """Its row, not yet added to a session."""
        return new_job(model=self.model, request=self.request, priority=self.priority,
                       max_attempts=self.max_attempts, metadata=self.metadata, idempotency_key=idempotency_key,
                       batch_id=self.batch_id, custom_id=self.custom_id, tenant=self.tenant,
                       dispatched=self.dispatched)


def add_job(session: Session, new: NewJob, idempotency_key: str | None = None) -> Job:
    """The job's row, written (flushed) in `session`."""
    job = new.job(idempotency_key)
    session.add(job)
    session.flush()
    return job


def create_job(session: Session, **fields: Any) -> Job:
    """A queued job, written (flushed) in `session`; `fields` as new_job's."""
    job = new_job(**fields)
    session.add(job)
    session.flush()
    return job


def new_job(
    *,
    model: str,
    request: dict[str, Any],
    priority: int = 5,
    max_attempts: int = 3,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    batch_id: str | None = None,
    custom_id: str | None = None,
    tenant: str = DEFAULT_TENANT,
    dispatched: bool = True,
) -> Job:
    """A queued job, not yet added to a session. `dispatched`: the caller sends its run_job message right
    after the commit; otherwise it waits in SQL until common.broker.dispatch sends it in its tenant's turn."""
    now = utcnow()
    return Job(
        id=new_id("job"),
        tenant=tenant,
        dispatched_at=now if dispatched else None,
        status=JobStatus.QUEUED,
        model=model,
        request=request,
        priority=priority,
        max_attempts=max_attempts,
        metadata_=metadata,
        idempotency_key=idempotency_key,
        batch_id=batch_id,
        custom_id=custom_id,
        attempts=0,
        created_at=now,
    )


def _claimable(now: datetime | BindParameter[datetime]) -> Any:
    expired = and_(Job.status == JobStatus.RUNNING, Job.lease_until < now)
    return and_(or_(Job.status == JobStatus.QUEUED, expired), Job.attempts < Job.max_attempts)


def _is_last_try() -> Any:
    return and_(Job.max_attempts > 1, Job.attempts + 1 >= Job.max_attempts)


def _held_by(job_id: Any, worker_id: Any) -> Any:
    return and_(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)


def _claimed_values(worker_id: Any, until: Any, now: Any) -> dict[str, Any]:
    """The columns a claim sets: plain values, or bound parameters in the prebuilt Postgres statement."""
    return {"status": JobStatus.RUNNING, "lease_owner": worker_id, "lease_until": until,
            "attempts": Job.attempts + 1, "started_at": now}


def _succeeded_values(now: Any, result_key: Any, text: Any, finish_reason: Any, prompt_tokens: Any,
                      completion_tokens: Any) -> dict[str, Any]:
    """The columns a finish sets: plain values, or the unnested results' columns on Postgres."""
    return {"status": JobStatus.SUCCEEDED, "finished_at": now, "lease_until": None, "result_key": result_key,
            "result_text": text, "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "error_code": None, "error_message": None}


def claim(session: Session, job_id: str, worker_id: str, lease_seconds: float, *,
          unless_last_try: bool = False) -> Job | None:
    """Take the job for `worker_id`; None when someone else has it or it is finished (a duplicate message),
    or, with `unless_last_try`, when this would start its last attempt (of several)."""
    now = utcnow()
    condition = _claimable(now)
    if unless_last_try:
        condition = and_(condition, ~_is_last_try())
    stmt = (
        update(Job)
        .where(Job.id == job_id, condition)
        .values(**_claimed_values(worker_id, now + timedelta(seconds=lease_seconds), now))
        .returning(Job)  # one round trip: the claimed row comes back with the UPDATE
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    return session.scalars(stmt).one_or_none()


# The grouped statements are Core, not ORM-enabled: they run the same through a session or a plain connection.
_JOBS = Job.__table__


def claim_many(executor: Session | Connection, job_ids: list[str], worker_id: str,
               lease_seconds: float) -> dict[str, ClaimedJob]:
    """`claim(..., unless_last_try=True)` of several jobs in one statement: those this worker took, by id. A
    Core statement (no ORM instances), so a plain connection runs it as well as a session."""
    if not job_ids:
        return {}
    now = utcnow()
    until = now + timedelta(seconds=lease_seconds)
    if _is_postgres(executor):
        rows = executor.execute(_PG_CLAIM_MANY, {"ids": job_ids, "worker": worker_id, "now": now, "until": until})
    else:
        rows = executor.execute(
            update(_JOBS).where(Job.id.in_(job_ids), _claimable(now), ~_is_last_try())
            .values(**_claimed_values(worker_id, until, now)).returning(*CLAIMED_COLUMNS))
    return {row.id: ClaimedJob.of(row) for row in rows}


def _is_postgres(executor: Session | Connection) -> bool:
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    return bind.dialect.name == "postgresql"


# The grouped claim and finish on Postgres: built once, with every value a bound parameter (the ids and the
# results as arrays), so the SQL is the same for any group size and SQLAlchemy compiles it once. An IN list or
# a VALUES list is a new statement for each size and content; at the few jobs a worker's groups often hold,
# building and compiling such a statement costs more CPU than its round trip (bench/state_writes.py).
_NOW = bindparam("now", type_=UTCDateTime())
_PG_CLAIM_MANY = (
    update(_JOBS)
    .where(Job.id == any_(bindparam("ids", type_=ARRAY(String))), _claimable(_NOW), ~_is_last_try())
    .values(**_claimed_values(bindparam("worker", type_=String()), bindparam("until", type_=UTCDateTime()), _NOW))
    .returning(*CLAIMED_COLUMNS)
)
# NulSafeText as on the column itself: a model may generate NUL, which Postgres text cannot hold.
_RESULTS = func.unnest(
    bindparam("ids", type_=ARRAY(String)), bindparam("keys", type_=ARRAY(String)),
    bindparam("texts", type_=ARRAY(NulSafeText)), bindparam("reasons", type_=ARRAY(String)),
    bindparam("prompt_tokens", type_=ARRAY(Integer)), bindparam("completion_tokens", type_=ARRAY(Integer)),
).table_valued(
    column("id", String), column("result_key", String), column("text", NulSafeText), column("finish_reason", String),
    column("prompt_tokens", Integer), column("completion_tokens", Integer),
).render_derived(name="results")
_PG_FINISH_MANY = (
    update(_JOBS)
    .where(_held_by(_RESULTS.c.id, bindparam("worker", type_=String())))
    .values(**_succeeded_values(_NOW, _RESULTS.c.result_key, _RESULTS.c.text, _RESULTS.c.finish_reason,
                                _RESULTS.c.prompt_tokens, _RESULTS.c.completion_tokens))
    .returning(_JOBS.c.id)
)


# On SQLite the results come as one JSON array of rows, read by json_each: one statement for any group.
_SQLITE_RESULTS = func.json_each(bindparam("results", type_=String())).table_valued("value").alias("results")


def _sqlite_result(index: int, type_: Any) -> Any:
    return func.json_extract(_SQLITE_RESULTS.c.value, f"$[{index}]", type_=type_)


_SQLITE_FINISH_MANY = (
    update(_JOBS)
    .where(_held_by(_sqlite_result(0, String()), bindparam("worker", type_=String())))
    .values(**_succeeded_values(_NOW, _sqlite_result(1, String()), _sqlite_result(2, Text()), _sqlite_result(
        3, String()), _sqlite_result(4, Integer()), _sqlite_result(5, Integer())))
    .returning(_JOBS.c.id)
)


def is_claimable_last_try(session: Session, job_id: str) -> bool:
    """Whether the job could be claimed now, for its last attempt (of several)."""
    stmt = select(Job.id).where(Job.id == job_id, _claimable(utcnow()), _is_last_try())
    return session.scalar(stmt) is not None


def heartbeat(session: Session, job_ids: list[str], worker_id: str, lease_seconds: float) -> int:
    """Extend the leases this worker still holds; returns how many it still holds."""
    if not job_ids:
        return 0
    stmt = (
        update(Job)
        .where(Job.id.in_(job_ids), Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
        .values(lease_until=utcnow() + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt)


def held_by(session: Session, job_ids: list[str], worker_id: str) -> set[str]:
    """Those of `job_ids` that `worker_id` still runs (not cancelled, not taken over by another worker)."""
    if not job_ids:
        return set()
    rows = session.scalars(
        select(Job.id).where(Job.id.in_(job_ids), Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
    )
    return set(rows)


def finish(session: Session | Connection, job_id: str, worker_id: str, result: JobResult) -> bool:
    """Mark succeeded; refused (False) if the worker lost its lease or the job was cancelled."""
    stmt = (
        update(Job)
        .where(_held_by(job_id, worker_id))
        .values(**_succeeded_values(utcnow(), result.result_key, result.text, result.finish_reason,
                                    result.prompt_tokens, result.completion_tokens))
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def finish_many(session: Session | Connection, worker_id: str, results: dict[str, JobResult]) -> set[str]:
    """`finish` of several jobs: the ids it marked succeeded; the others this worker no longer held. On Postgres
    one statement (an UPDATE joined to the results unnested from arrays); on SQLite one UPDATE per job (in the
    caller's one transaction all the same)."""
    if not results:
        return set()
    if not _is_postgres(session):
        text_of = NulSafeText().process_bind_param
        payload = json.dumps([[job_id, r.result_key, text_of(r.text, None), r.finish_reason, r.prompt_tokens,
                               r.completion_tokens] for job_id, r in results.items()])
        return set(session.scalars(_SQLITE_FINISH_MANY, {"results": payload, "worker": worker_id, "now": utcnow()}))
    rows = list(results.values())
    params = {"ids": list(results), "keys": [r.result_key for r in rows], "texts": [r.text for r in rows],
              "reasons": [r.finish_reason for r in rows], "prompt_tokens": [r.prompt_tokens for r in rows],
              "completion_tokens": [r.completion_tokens for r in rows], "worker": worker_id, "now": utcnow()}
    return set(session.scalars(_PG_FINISH_MANY, params))


def fail(session: Session, job_id: str, worker_id: str, code: str, message: str) -> bool:
    """Terminal failure for input errors that would fail again on retry."""
    stmt = (
        update(Job)
        .where(_held_by(job_id, worker_id))
        .values(
            status=JobStatus.FAILED,
            finished_at=utcnow(),
            lease_until=None,
            error_code=code,
            error_message=message[:4000],
        )
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt) == 1


def release(session: Session, job_id: str, worker_id: str, code: str, message: str) -> JobStatus | None:
    """Give a job back after a transient error: `queued` again, or `dead` once attempts are used up.

    Returns the new status, or None when the worker no longer held the job."""
    base = _held_by(job_id, worker_id)
    dead = (
        update(Job)
        .where(base, Job.attempts >= Job.max_attempts)
        .values(status=JobStatus.DEAD, finished_at=utcnow(), lease_owner=None, lease_until=None,
                error_code=code, error_message=message[:4000])
        .execution_options(synchronize_session=False)
    )
    if rowcount(session, dead) == 1:
        return JobStatus.DEAD
    requeue = (
        update(Job)
        .where(base)
        .values(status=JobStatus.QUEUED, lease_owner=None, lease_until=None,
                error_code=code, error_message=message[:4000])
        .execution_options(synchronize_session=False)
    )
    return JobStatus.QUEUED if rowcount(session, requeue) == 1 else None


def cancel(session: Session, job_id: str) -> bool:
    """Cancel a job that has not finished; a worker still running it will have its finish refused."""
    return cancel_many(session, [job_id]) == 1


def cancel_many(session: Session, job_ids: list[str], statuses: tuple[str, ...] = (JobStatus.QUEUED,
                                                                                 JobStatus.RUNNING)) -> int:
    """`cancel` of those of `job_ids` whose status is one of `statuses` (open ones), in one statement; returns
    how many it cancelled."""
    if not set(statuses) <= {JobStatus.QUEUED, JobStatus.RUNNING}:
        raise ValueError(f"only open jobs are cancelled, not {statuses}")
    if not job_ids:
        return 0
    return _cancel_where(session, Job.id.in_(job_ids), Job.status.in_(statuses))


def cancel_running_of_batch(session: Session, batch_id: str) -> int:
    """`cancel` of every running job of a batch, in one statement (ix_jobs_batch_id_status): no more of them
    than workers hold at once. Returns how many it cancelled."""
    return _cancel_where(session, Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)


def _cancel_where(session: Session, *where: Any) -> int:
    stmt = (
        update(Job)
        .where(*where)
        .values(status=JobStatus.CANCELLED, finished_at=utcnow(), lease_owner=None, lease_until=None)
        .execution_options(synchronize_session=False)
    )
    return rowcount(session, stmt)


def reap(session: Session, limit: int = 1000, *, every_lease: bool = False) -> dict[str, list[str]]:
    """Expired leases go back to `queued`, or to `dead` when attempts are used up. `every_lease`: every running
    job's, expired or not, for a process that knows no other worker can hold one (worker/embedded.py)."""
    now = utcnow()
    cutoff = datetime(9999, 1, 1, tzinfo=UTC) if every_lease else now
    expired_ids = list(
        session.scalars(
            select(Job.id)
            .where(Job.status == JobStatus.RUNNING, Job.lease_until < cutoff)
            .order_by(Job.lease_until)
            .limit(limit)
        )
    )
    outcome: dict[str, list[str]] = {JobStatus.QUEUED: [], JobStatus.DEAD: []}
    for job_id in expired_ids:
        still_expired = and_(Job.id == job_id, Job.status == JobStatus.RUNNING, Job.lease_until < cutoff)
        dead = (
            update(Job)
            .where(still_expired, Job.attempts >= Job.max_attempts)
            .values(status=JobStatus.DEAD, finished_at=now, lease_owner=None, lease_until=None,
                    error_code="lease_expired", error_message="worker lost; attempts exhausted")
            .execution_options(synchronize_session=False)
        )
        if rowcount(session, dead) == 1:
            outcome[JobStatus.DEAD].append(job_id)
            continue
        requeue = (
            update(Job)
            .where(still_expired)
            # Unsent: its message was consumed by the worker that died, so dispatch sends it again.
            .values(status=JobStatus.QUEUED, lease_owner=None, lease_until=None, dispatched_at=None)
            .execution_options(synchronize_session=False)
        )
        if rowcount(session, requeue) == 1:
            outcome[JobStatus.QUEUED].append(job_id)
    return outcome
