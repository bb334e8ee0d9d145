"""What the status page shows, as one JSON document: batches with progress and ETA, recent failures, the live
processes and their throughput, queue depths and job counts.

A tenant's key sees its own batches, failures and job counts, and nothing else; keys of `admin_tenants` (and
everyone when auth is off, in embedded mode) see all tenants, and the figures no tenant owns: the live
processes (jobs in flight, throughput, cache hit rates) and the queue depths. Those move with what every tenant
sends, so a tenant watching them would learn of the others' work.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.deps import AppState
from common.broker.stats import queue_depths
from common.domain.batches import batch_view
from common.domain.models import BATCH_FINAL_STATUSES, Batch, Job, JobStatus
from common.infra.worker_registry import WorkerRegistry

OPEN_BATCHES_SHOWN = 50
FINISHED_BATCHES_SHOWN = 20
FAILURES_SHOWN = 20
ERROR_CHARS = 500


def _ts(value: Any) -> float | None:
    return value.timestamp() if value is not None else None


def _batches(session: Session, tenant: str | None) -> list[dict[str, Any]]:
    scoped = select(Batch) if tenant is None else select(Batch).where(Batch.tenant == tenant)
    final = [str(s) for s in BATCH_FINAL_STATUSES]
    open_ = session.scalars(scoped.where(Batch.status.not_in(final)).order_by(Batch.id.desc())
                            .limit(OPEN_BATCHES_SHOWN)).all()
    done = session.scalars(scoped.where(Batch.status.in_(final)).order_by(Batch.id.desc())
                           .limit(FINISHED_BATCHES_SHOWN)).all()
    return [{**batch_view(session, b), "tenant": b.tenant} for b in [*open_, *done]]


def _failures(session: Session, tenant: str | None) -> list[dict[str, Any]]:
    """A tenant's own failed jobs, without the worker that ran them (a process name is admins' business)."""
    # Served by ix_jobs_status_lease_until (status first): cost grows with failed+dead jobs, not all jobs.
    stmt = select(Job).where(Job.status.in_((JobStatus.FAILED, JobStatus.DEAD)))
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    rows = session.scalars(stmt.order_by(Job.finished_at.desc().nulls_last(), Job.id.desc())
                           .limit(FAILURES_SHOWN)).all()
    return [{"id": j.id, "tenant": j.tenant, "batch_id": j.batch_id, "custom_id": j.custom_id, "status": j.status,
             "attempts": j.attempts, "error_code": j.error_code,
             "error_message": (j.error_message or "")[:ERROR_CHARS], "finished_at": _ts(j.finished_at),
             **({"worker": j.lease_owner} if tenant is None else {})} for j in rows]


def _job_counts(session: Session, tenant: str | None) -> dict[str, int]:
    stmt = select(Job.status, func.count()).group_by(Job.status)
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    counts = {str(s): 0 for s in JobStatus}
    counts.update({str(status): n for status, n in session.execute(stmt).all()})
    return counts


def status_report(state: AppState, registry: WorkerRegistry, tenant: str | None) -> dict[str, Any]:
    """`tenant` None: every tenant's, with the processes and queues; else that tenant's jobs and batches only."""
    with state.db.session() as session:
        batches = _batches(session, tenant)
        failures = _failures(session, tenant)
        jobs = _job_counts(session, tenant)
    report: dict[str, Any] = {"tenant": tenant, "generated_at": time.time(), "jobs": jobs, "batches": batches,
                              "failures": failures, "errors": {}}
    if tenant is None:
        report.update(_shared_figures(state, registry, report["errors"]))
    return report


def _shared_figures(state: AppState, registry: WorkerRegistry, errors: dict[str, str]) -> dict[str, Any]:
    """The queue depths and the live processes: every tenant's load, for admins."""
    try:
        queues = queue_depths(state.settings.broker_url)
    except Exception as exc:
        queues, errors["queues"] = {}, f"{type(exc).__name__}: {exc}"
    now = time.time()
    try:
        processes = [{**r, "age_s": round(now - float(r.get("updated_at", now)), 1)} for r in registry.list()]
    except Exception as exc:
        processes, errors["processes"] = [], f"{type(exc).__name__}: {exc}"
    return {"queues": queues, "processes": processes}
