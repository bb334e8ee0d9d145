"""Fair dispatch on SQLite and Postgres: each tenant holds a window of the broker, refilled as jobs end.

The broker here is a priority queue in the test (FIFO within a priority, like Redis with priority steps) and
the worker a loop that claims and finishes the next message through common.domain.jobs, then tops up as a real
worker does after each job; SQL is the real database.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy import update as sa_update

from common.broker import dispatch
from common.domain import jobs
from common.domain.models import Job, JobStatus, new_id, utcnow
from common.infra.db import Database

MODEL = "m"
REQUEST: dict[str, Any] = {"messages": [], "sampling": {}}
RESULT = jobs.JobResult("results/x.json", "ok", "stop", 1, 1)


class Broker:
    def __init__(self) -> None:
        self.messages: list[tuple[int, int, str]] = []  # (-priority, arrival, job id)
        self.arrivals = itertools.count()
        self.fail = False

    def send(self, model: str, job_ids: list[str], priority: int) -> None:
        assert model == MODEL
        if self.fail:
            raise ConnectionError("broker down")
        self.messages += [(-priority, next(self.arrivals), job_id) for job_id in job_ids]

    def pop(self) -> str | None:
        if not self.messages:
            return None
        self.messages.sort()
        return self.messages.pop(0)[2]


def add_batch_jobs(db: Database, tenant: str, count: int, batch_id: str | None = None) -> list[str]:
    batch_id = batch_id or new_id("batch")
    rows: list[dict[str, Any]] = [
        {"id": new_id("job"), "tenant": tenant, "status": JobStatus.QUEUED, "model": MODEL, "priority": 2,
         "request": REQUEST, "batch_id": batch_id, "custom_id": str(i), "attempts": 0, "max_attempts": 3,
         "created_at": utcnow(), "dispatched_at": None} for i in range(count)]
    with db.session() as session:
        session.execute(insert(Job), rows)
    return [r["id"] for r in rows]


def tenant_of(db: Database, job_id: str) -> str:
    with db.session() as session:
        return session.scalar(select(Job.tenant).where(Job.id == job_id)) or ""


def run_one(db: Database, broker: Broker, window: int) -> str | None:
    """What a worker does with the next message: claim, finish, top up; the finished job's id."""
    job_id = broker.pop()
    if job_id is None:
        return None
    with db.session() as session:
        claimed = jobs.claim(session, job_id, "w", 60)
    if claimed is None:
        return run_one(db, broker, window)  # a duplicate message
    with db.session() as session:
        assert jobs.finish(session, job_id, "w", RESULT)
    dispatch.top_up_after_job(db, claimed.tenant, claimed.model, window, broker.send)
    return job_id


def test_two_tenants_share_the_workers(db: Database) -> None:
    window, broker = 8, Broker()
    big = add_batch_jobs(db, "big", 200)
    assert dispatch.top_up(db, "big", MODEL, window, broker.send) == window  # ingestion of the big batch
    for _ in range(20):  # the big tenant has the workers to itself for a while
        run_one(db, broker, window)
    small = add_batch_jobs(db, "small", 20)
    assert dispatch.top_up(db, "small", MODEL, window, broker.send) == window
    order = []
    while (job_id := run_one(db, broker, window)) is not None:
        order.append(tenant_of(db, job_id))
        with db.session() as session:
            for tenant in ("big", "small"):  # the broker never holds more than a window of anyone
                assert dispatch.in_flight(session, tenant, MODEL) <= window
    assert Counter(order) == {"big": 180, "small": 20}
    last_small = max(i for i, tenant in enumerate(order) if tenant == "small")
    # Without windows the small batch would wait behind all 180 remaining big jobs; with them the two
    # alternate, so the small batch is done after about as many big jobs as it has.
    assert last_small < 2 * 20 + 2 * window, (last_small, order)
    with db.session() as session:
        statuses = set(session.scalars(select(Job.status).where(Job.id.in_(big + small))))
    assert statuses == {JobStatus.SUCCEEDED}


def test_single_jobs_outrank_batch_jobs_and_count_against_the_window(db: Database) -> None:
    window, broker = 4, Broker()
    add_batch_jobs(db, "t", 10)
    dispatch.top_up(db, "t", MODEL, window, broker.send)
    with db.session() as session:
        single = jobs.create_job(session, model=MODEL, request=REQUEST, tenant="t", priority=5).id
    broker.send(MODEL, [single], 5)  # as POST /v1/jobs does right after its commit
    assert run_one(db, broker, window) == single
    with db.session() as session:
        assert dispatch.in_flight(session, "t", MODEL) == window  # topped up after the single job


def test_a_failed_send_leaves_jobs_unsent_and_the_sweep_sends_them(db: Database) -> None:
    window, broker = 5, Broker()
    ids = add_batch_jobs(db, "t", 3)
    broker.fail = True
    with pytest.raises(ConnectionError):
        dispatch.top_up(db, "t", MODEL, window, broker.send)
    with db.session() as session:
        assert dispatch.in_flight(session, "t", MODEL) == 0
        assert dispatch.waiting_pairs(session) == [("t", MODEL)]
    broker.fail = False
    assert dispatch.top_up_all(db, window, broker.send) == 3
    assert sorted(m[2] for m in broker.messages) == sorted(ids)
    assert dispatch.top_up_all(db, window, broker.send) == 0  # nothing sent twice


def test_a_job_written_sent_at_once_and_refused_by_the_broker_is_sent_by_the_next_top_up(db: Database) -> None:
    """POST /v1/jobs and the API's group writer send a committed job's message at once
    (dispatch.send_or_mark_unsent): a broker that refuses leaves the job unsent, never sent-without-a-message."""
    window, broker = 5, Broker()
    ids = add_batch_jobs(db, "t", 2)
    with db.session() as session:
        session.execute(sa_update(Job).where(Job.id.in_(ids)).values(dispatched_at=utcnow()))
    broker.fail = True
    assert not dispatch.send_or_mark_unsent(db, ids, lambda: broker.send(MODEL, ids, 5))
    with db.session() as session:
        assert dispatch.in_flight(session, "t", MODEL) == 0
    broker.fail = False
    assert dispatch.send_or_mark_unsent(db, ids[:1], lambda: broker.send(MODEL, ids[:1], 5))
    assert dispatch.top_up_all(db, window, broker.send) == 2
    assert sorted(m[2] for m in broker.messages) == sorted([ids[0], *ids])


def test_reaped_jobs_are_sent_again(db: Database) -> None:
    window, broker = 5, Broker()
    (job_id,) = add_batch_jobs(db, "t", 1)
    dispatch.top_up(db, "t", MODEL, window, broker.send)
    with db.session() as session:
        assert jobs.claim(session, job_id, "dead-worker", lease_seconds=0.001) is not None
    broker.messages.clear()  # the dead worker had consumed the message
    import time

    time.sleep(0.01)
    with db.session() as session:
        assert jobs.reap(session)[JobStatus.QUEUED] == [job_id]
    assert dispatch.top_up_all(db, window, broker.send) == 1
    assert run_one(db, broker, window) == job_id


def test_refill_waits_for_enough_room(db: Database) -> None:
    window, broker = 32, Broker()
    add_batch_jobs(db, "t", 100)
    dispatch.top_up(db, "t", MODEL, window, broker.send)
    sent_before = len(broker.messages)
    run_one(db, broker, window)  # one slot free: below the refill threshold (window // 16 = 2)
    assert len(broker.messages) == sent_before - 1
    run_one(db, broker, window)  # two free: refilled to the full window
    assert len(broker.messages) == window
