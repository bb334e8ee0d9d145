"""The job state machine on SQLite and Postgres: every transition is a conditional update."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from sqlalchemy import event, update

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.domain.models import Job, JobStatus, utcnow
from common.infra.db import Database

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}}
RESULT = jobs.JobResult("results/x.json", "hello", "stop", 7, 2)


def _new_job(db: Database, max_attempts: int = 3) -> str:
    with db.session() as s:
        return jobs.create_job(s, model="m", request=REQUEST, max_attempts=max_attempts).id


def _get(db: Database, job_id: str) -> Job:
    with db.session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


def test_claim_twice_one_wins(db: Database) -> None:
    job_id = _new_job(db)
    with db.session() as s:
        first = jobs.claim(s, job_id, "w1", 60)
    with db.session() as s:
        second = jobs.claim(s, job_id, "w2", 60)
    assert first is not None and first.status == JobStatus.RUNNING and first.lease_owner == "w1"
    assert second is None
    job = _get(db, job_id)
    assert job.attempts == 1 and job.lease_owner == "w1" and job.started_at is not None


def test_concurrent_claims_exactly_one_wins(db: Database) -> None:
    job_id = _new_job(db)
    winners: list[str] = []
    barrier = threading.Barrier(8)

    def attempt(name: str) -> None:
        barrier.wait()
        with db.session() as s:
            if jobs.claim(s, job_id, name, 60) is not None:
                winners.append(name)

    threads = [threading.Thread(target=attempt, args=(f"w{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert _get(db, job_id).lease_owner == winners[0]


def test_finish_by_worker_that_lost_its_lease_is_refused(db: Database) -> None:
    job_id = _new_job(db)
    with db.session() as s:
        assert jobs.claim(s, job_id, "w1", 60) is not None
    # w1's lease runs out and w2 takes the job over.
    with db.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_until=utcnow() - timedelta(seconds=1)))
    with db.session() as s:
        assert jobs.claim(s, job_id, "w2", 60) is not None
    with db.session() as s:
        assert jobs.finish(s, job_id, "w1", RESULT) is False
    with db.session() as s:
        assert jobs.finish(s, job_id, "w2", RESULT) is True
    job = _get(db, job_id)
    assert job.status == JobStatus.SUCCEEDED and job.result_text == "hello" and job.attempts == 2
    with db.session() as s:  # terminal stays terminal
        assert jobs.finish(s, job_id, "w2", RESULT) is False
        assert jobs.cancel(s, job_id) is False
        assert jobs.claim(s, job_id, "w3", 60) is None


def test_heartbeat_extends_only_own_leases(db: Database) -> None:
    a, b = _new_job(db), _new_job(db)
    with db.session() as s:
        jobs.claim(s, a, "w1", 1)
        jobs.claim(s, b, "w2", 1)
    before = _get(db, a).lease_until
    with db.session() as s:
        assert jobs.heartbeat(s, [a, b], "w1", 120) == 1
    after_a, after_b = _get(db, a).lease_until, _get(db, b).lease_until
    assert before is not None and after_a is not None and after_b is not None
    assert after_a > before + timedelta(seconds=60)
    assert after_b < utcnow() + timedelta(seconds=5)


def test_release_requeues_then_dead_after_max_attempts(db: Database) -> None:
    job_id = _new_job(db, max_attempts=2)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", 60)
        assert jobs.release(s, job_id, "w1", "worker_error", "boom") == JobStatus.QUEUED
    job = _get(db, job_id)
    assert job.status == JobStatus.QUEUED and job.lease_owner is None and job.error_message == "boom"
    with db.session() as s:
        jobs.claim(s, job_id, "w2", 60)
        assert jobs.release(s, job_id, "w2", "worker_error", "boom again") == JobStatus.DEAD
    job = _get(db, job_id)
    assert job.status == JobStatus.DEAD and job.attempts == 2 and job.finished_at is not None
    with db.session() as s:
        assert jobs.claim(s, job_id, "w3", 60) is None


def test_fail_is_terminal(db: Database) -> None:
    job_id = _new_job(db)
    with db.session() as s:
        jobs.claim(s, job_id, "w1", 60)
        assert jobs.fail(s, job_id, "w1", "invalid_input", "bad image") is True
    job = _get(db, job_id)
    assert job.status == JobStatus.FAILED and job.error_code == "invalid_input"
    with db.session() as s:
        assert jobs.claim(s, job_id, "w1", 60) is None


def test_cancel_queued_and_running_refuses_late_finish(db: Database) -> None:
    queued, running = _new_job(db), _new_job(db)
    with db.session() as s:
        jobs.claim(s, running, "w1", 60)
    with db.session() as s:
        assert jobs.cancel(s, queued) is True
        assert jobs.cancel(s, running) is True
    with db.session() as s:
        assert jobs.finish(s, running, "w1", RESULT) is False
        assert jobs.claim(s, queued, "w1", 60) is None
    assert _get(db, running).status == JobStatus.CANCELLED
    assert _get(db, queued).status == JobStatus.CANCELLED


def test_cancel_many_cancels_the_open_ones_of_its_statuses(db: Database) -> None:
    queued, running, done, other = _new_job(db), _new_job(db), _new_job(db), _new_job(db)
    with db.session() as s:
        jobs.claim(s, running, "w1", 60)
        jobs.claim(s, done, "w1", 60)
        assert jobs.finish(s, done, "w1", RESULT)
    with db.session() as s:
        assert jobs.cancel_many(s, [queued, running], (JobStatus.RUNNING,)) == 1  # only the running one
        assert jobs.cancel_many(s, [queued, running, done]) == 1  # the queued one; the others have ended
        assert jobs.cancel_many(s, []) == 0
    with db.session() as s:
        assert jobs.finish(s, running, "w1", RESULT) is False  # its worker's finish is refused
    assert [_get(db, j).status for j in (queued, running, done, other)] == [
        JobStatus.CANCELLED, JobStatus.CANCELLED, JobStatus.SUCCEEDED, JobStatus.QUEUED]
    assert _get(db, running).lease_owner is None and _get(db, done).result_text == "hello"


def test_reap_requeues_expired_and_kills_exhausted(db: Database) -> None:
    again, exhausted, alive = _new_job(db, 3), _new_job(db, 1), _new_job(db, 3)
    with db.session() as s:
        for job_id in (again, exhausted):
            jobs.claim(s, job_id, "w1", 0.01)
        jobs.claim(s, alive, "w1", 600)
    time.sleep(0.05)
    with db.session() as s:
        outcome = jobs.reap(s)
    assert outcome[JobStatus.QUEUED] == [again]
    assert outcome[JobStatus.DEAD] == [exhausted]
    assert _get(db, again).status == JobStatus.QUEUED
    assert _get(db, exhausted).status == JobStatus.DEAD
    assert _get(db, alive).status == JobStatus.RUNNING


def test_claim_many_takes_only_what_claim_would(db: Database) -> None:
    fresh, taken, last_try = _new_job(db), _new_job(db), _new_job(db, max_attempts=2)
    with db.session() as s:
        assert jobs.claim(s, taken, "other", 60) is not None
        s.execute(update(Job).where(Job.id == last_try).values(attempts=1))
    with db.session() as s:
        claimed = jobs.claim_many(s, [fresh, taken, last_try, "job_missing"], "w1", 60)
    assert set(claimed) == {fresh}  # held by another worker; would start its last try; does not exist
    row = _get(db, fresh)
    assert row.status == JobStatus.RUNNING and row.lease_owner == "w1" and row.attempts == 1
    assert claimed[fresh] == ClaimedJob.of(row)
    assert _get(db, taken).lease_owner == "other" and _get(db, last_try).status == JobStatus.QUEUED
    with db.session() as s:
        assert jobs.claim_many(s, [], "w1", 60) == {}


def test_claim_many_on_a_plain_connection_returns_what_the_worker_needs(db: Database) -> None:
    """The worker's state writer claims on a connection, without the ORM: each job comes back with its request
    decoded, its creation time in UTC and this attempt counted, exactly as the row holds them."""
    with db.session() as s:
        batch_job = jobs.create_job(s, model="m2", request=REQUEST, priority=8, tenant="acme", batch_id="batch_1")
    ids = [batch_job.id, _new_job(db)]
    with db.engine.begin() as connection:
        claimed = jobs.claim_many(connection, ids, "w1", 60)
    assert set(claimed) == set(ids)
    for job_id in ids:
        row = _get(db, job_id)
        job = claimed[job_id]
        assert job == ClaimedJob.of(row) and job.attempts == 1 and row.lease_owner == "w1"
        assert job.request == REQUEST and job.created_at.tzinfo is not None
    assert (claimed[ids[0]].tenant, claimed[ids[0]].model, claimed[ids[0]].priority,
            claimed[ids[0]].batch_id) == ("acme", "m2", 8, "batch_1")
    with db.engine.begin() as connection:
        assert jobs.claim_many(connection, ids, "w2", 60) == {}  # held now
        assert jobs.finish_many(connection, "w1", {i: RESULT for i in ids}) == set(ids)
    assert {_get(db, i).status for i in ids} == {JobStatus.SUCCEEDED}


def test_finish_many_writes_each_result_and_refuses_jobs_not_held(db: Database) -> None:
    mine = [_new_job(db) for _ in range(3)]
    theirs, cancelled = _new_job(db), _new_job(db)
    with db.session() as s:
        jobs.claim_many(s, [*mine, cancelled], "w1", 60)
        jobs.claim(s, theirs, "w2", 60)
        jobs.cancel(s, cancelled)
    results = {job_id: jobs.JobResult(f"results/{job_id}.json", f"text of {job_id} \u00e9\u4e2d", "length", 10 + i,
                                      100_000 + i)
               for i, job_id in enumerate([*mine, theirs, cancelled])}
    with db.session() as s:
        finished = jobs.finish_many(s, "w1", results)
    assert finished == set(mine)
    for job_id in mine:
        job, want = _get(db, job_id), results[job_id]
        assert job.status == JobStatus.SUCCEEDED
        assert (job.result_key, job.result_text, job.finish_reason, job.prompt_tokens, job.completion_tokens) == (
            want.result_key, want.text, want.finish_reason, want.prompt_tokens, want.completion_tokens)
        assert job.lease_until is None and job.finished_at is not None
    assert _get(db, theirs).status == JobStatus.RUNNING and _get(db, theirs).result_text is None
    assert _get(db, cancelled).status == JobStatus.CANCELLED
    with db.session() as s:
        assert jobs.finish_many(s, "w1", {}) == set()


def test_finish_many_stores_text_with_nul_in_one_statement(db: Database) -> None:
    """Random and real models do generate NUL; the grouped finish escapes it as the column type does (it
    had bound plain text, so on Postgres every group holding such a result failed and was rewritten job by
    job)."""
    ids = [_new_job(db) for _ in range(3)]
    with db.session() as s:
        jobs.claim_many(s, ids, "w1", 60)
    texts = {ids[0]: "a\x00b", ids[1]: "\x00\ue000\x00", ids[2]: "plain"}
    with db.session() as s:
        finished = jobs.finish_many(s, "w1", {job_id: jobs.JobResult(f"results/{job_id}.json", text, "stop", 1, 1)
                                              for job_id, text in texts.items()})
    assert finished == set(ids)
    for job_id, text in texts.items():
        assert _get(db, job_id).result_text == text


def test_grouped_claim_and_finish_send_the_same_sql_for_any_group_size(db: Database) -> None:
    """On Postgres the ids and results travel as arrays, so SQLAlchemy compiles each statement once; an IN or
    VALUES list was a new statement, built and compiled again, for every group size. On SQLite the finishes travel
    as one JSON array (one statement); its claims are an IN list."""
    postgres = db.engine.dialect.name == "postgresql"
    sent: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda *args: sent.append(args[2]))
    for size in (1, 3, 7):
        ids = [_new_job(db) for _ in range(size)]
        sent.clear()
        with db.session() as s:
            assert set(jobs.claim_many(s, ids, "w1", 60)) == set(ids)
            assert jobs.finish_many(s, "w1", {i: jobs.JobResult(f"r/{i}", "t", "stop", 1, 1) for i in ids}) == set(ids)
        statements = [sql for sql in sent if sql.startswith("UPDATE") and (postgres or "json_each" in sql)]
        assert len(statements) == (2 if postgres else 1)
        if size == 1:
            first = statements
        assert statements == first
