"""worker/jobs/state_writer.py on SQLite and Postgres: claims and finishes asked for together share one
transaction, each caller gets its own answer, and one bad row fails only its own caller."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.domain.models import JobStatus
from common.infra.db import Database
from tests.common.conftest import db  # noqa: F401  (the fixture: a migrated database of each kind)
from tests.common.domain.test_jobs import _get, _new_job
from worker.jobs.state_writer import StateWriter


@pytest.fixture
def writer(db: Database) -> Iterator[StateWriter]:  # noqa: F811
    w = StateWriter(db, "w1", lease_seconds=60)
    yield w
    w.close()


def _hold_first_group(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the writer's first transaction wait, so that what is asked meanwhile piles up into the next."""
    entered, release = threading.Event(), threading.Event()
    real = jobs.claim_many

    def claim_many(*args: object, **kwargs: object) -> object:
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jobs, "claim_many", claim_many)
    return entered, release


def test_concurrent_claims_and_finishes_share_a_transaction(db: Database, writer: StateWriter,  # noqa: F811
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [_new_job(db) for _ in range(20)]
    to_finish = ids[:10]
    with db.session() as s:
        jobs.claim_many(s, to_finish, "w1", 60)
    entered, release = _hold_first_group(monkeypatch)
    with ThreadPoolExecutor(24) as pool:
        blocker = pool.submit(writer.claim, ids[10])
        assert entered.wait(10)
        claims = {job_id: pool.submit(writer.claim, job_id) for job_id in ids[11:]}
        duplicate = pool.submit(writer.claim, ids[11])  # a second delivery of the same job in the same group
        finishes = {job_id: pool.submit(writer.finish, job_id, jobs.JobResult(f"r/{job_id}", job_id, "stop", 1, 2))
                    for job_id in to_finish}
        while writer.committer.num_waiting < len(claims) + 1 + len(finishes):
            threading.Event().wait(0.01)
        release.set()
        assert blocker.result(10) is not None
        claimed = {job_id: f.result(10) for job_id, f in claims.items()}
        finished = {job_id: f.result(10) for job_id, f in finishes.items()}
        second = duplicate.result(10)
    assert writer.num_transactions == 2  # the held one, then everything that piled up behind it
    assert all(isinstance(job, ClaimedJob) and job.id == job_id and job.attempts == 1 and job.request
               for job_id, job in claimed.items())
    assert second is None  # the claim went to one of the two deliveries only
    assert all(finished.values())
    for job_id in to_finish:
        job = _get(db, job_id)
        assert job.status == JobStatus.SUCCEEDED and job.result_text == job_id
    for job_id in ids[10:]:
        assert _get(db, job_id).status == JobStatus.RUNNING


def test_one_bad_row_fails_only_its_caller(db: Database, writer: StateWriter,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [_new_job(db) for _ in range(6)]
    with db.session() as s:
        jobs.claim_many(s, ids[:5], "w1", 60)
    entered, release = _hold_first_group(monkeypatch)
    bad = jobs.JobResult("r/bad", object(), "stop", 1, 2)  # type: ignore[arg-type]  # no database binds it
    with ThreadPoolExecutor(8) as pool:
        blocker = pool.submit(writer.claim, ids[5])
        assert entered.wait(10)
        good = {job_id: pool.submit(writer.finish, job_id, jobs.JobResult("r/ok", "ok", "stop", 1, 2))
                for job_id in ids[:4]}
        failing = pool.submit(writer.finish, ids[4], bad)
        while writer.committer.num_waiting < 5:
            threading.Event().wait(0.01)
        release.set()
        blocker.result(10)
        assert all(f.result(10) for f in good.values())
        with pytest.raises(Exception):  # noqa: B017  (the driver's own error type differs per database)
            failing.result(10)
    assert [_get(db, job_id).status for job_id in ids[:5]] == [JobStatus.SUCCEEDED] * 4 + [JobStatus.RUNNING]
    assert writer.claim(_new_job(db)) is not None  # the writer carries on


def test_a_finish_for_a_job_no_longer_held_is_refused(db: Database, writer: StateWriter) -> None:  # noqa: F811
    job_id = _new_job(db)
    assert writer.claim(job_id) is not None
    with db.session() as s:
        jobs.cancel(s, job_id)
    assert writer.finish(job_id, jobs.JobResult("r/x", "x", "stop", 1, 1)) is False
    assert _get(db, job_id).status == JobStatus.CANCELLED


def test_closed_writer_refuses(db: Database) -> None:  # noqa: F811
    w = StateWriter(db, "w1", lease_seconds=60)
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.claim("job_x")


def test_claims_asked_within_the_linger_share_one_transaction(db: Database) -> None:  # noqa: F811
    """Staggered by less than the linger (not piled up behind a slow transaction): still one group."""
    ids = [_new_job(db) for _ in range(6)]
    w = StateWriter(db, "w1", lease_seconds=60, linger_seconds=0.5)
    try:
        def claim_after(i: int) -> object:
            threading.Event().wait(0.02 * i)
            return w.claim(ids[i])

        with ThreadPoolExecutor(6) as pool:
            claimed = list(pool.map(claim_after, range(6)))
        assert [job.id for job in claimed] == ids  # type: ignore[attr-defined]
        assert w.num_transactions == 1
    finally:
        w.close()
    lone = StateWriter(db, "w2", lease_seconds=60, linger_seconds=0.0)
    try:  # without a linger, the same staggered claims go one transaction each
        more = [_new_job(db) for _ in range(3)]
        for job_id in more:
            assert lone.claim(job_id) is not None
        assert lone.num_transactions == 3
    finally:
        lone.close()


def test_writer_outlives_its_postgres_connection(db: Database) -> None:  # noqa: F811
    """Its own connection has no pool ping: when Postgres drops it, the group in flight is written again on a
    new one and its callers never see the error."""
    if db.engine.dialect.name != "postgresql":
        pytest.skip("Postgres only: SQLite has no server connection to lose")
    from sqlalchemy import text

    w = StateWriter(db, "w1", lease_seconds=60)
    try:
        first, second = _new_job(db), _new_job(db)
        assert w.claim(first) is not None
        with db.session() as s:  # every other backend of this database: the writer's among them
            killed = s.execute(text("SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                    " WHERE datname = current_database() AND pid <> pg_backend_pid()) AS t")).scalar()
        assert killed is not None and killed >= 1
        assert w.claim(second) is not None
        assert w.finish(first, jobs.JobResult("r/1", "one", "stop", 1, 1)) is True
        assert _get(db, first).status == JobStatus.SUCCEEDED and _get(db, second).status == JobStatus.RUNNING
    finally:
        w.close()
