"""The job state machine (docs/architecture.md) driven by Hypothesis against the real database, on SQLite and Postgres.

Submits, claims by several workers, heartbeats, finishes, failures, releases, worker crashes (their leases put in
the past), reaps and cancels come in any order. A plain-Python model predicts every outcome, and after each step
the rows are compared with it and with the invariants: at most one accepted result per job, terminal states stay
terminal, attempts never exceed max_attempts, `running` only with a lease, a worker that lost its lease is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from sqlalchemy import delete, select, update

from common.domain import jobs
from common.domain.models import TERMINAL_STATUSES, Job, JobStatus, utcnow
from common.infra.db import Database

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}}
WORKERS = ("w0", "w1", "w2")
LEASE_SECONDS = 300.0  # a live lease never runs out during a run; crashes and stalls move lease_until back
KNOWN_STATUSES = frozenset(JobStatus)
JOB = st.integers(0, 7)  # an index into the jobs submitted so far (modulo their number)
# One rule draws the action from this list, weighted by repetition: separate rules let Hypothesis' swarm testing
# switch `claim` off in most runs, which then only exercise refusals.
ACTIONS = (
    ("claim",) * 4 + ("finish",) * 3 + ("release",) * 2 + ("heartbeat",) * 2 + ("leases_run_out",) * 2
    + ("reap",) * 2 + ("fail", "cancel", "submit")
)


@dataclass
class ModelJob:
    """What the model says a job's row must hold."""

    max_attempts: int
    status: str = JobStatus.QUEUED
    owner: str | None = None
    attempts: int = 0
    expired: bool = False  # running with lease_until in the past
    accepted_finishes: list[str] = field(default_factory=list)  # workers whose finish() returned True
    dispatched: bool = True


class JobStateMachine(RuleBasedStateMachine):
    def __init__(self, db: Database) -> None:
        super().__init__()
        self.db = db
        self.model: dict[str, ModelJob] = {}
        self.seen_terminal: dict[str, str] = {}  # job id -> the terminal status the row first showed
        self.inflight: dict[str, set[str]] = {w: set() for w in WORKERS}  # what each worker believes it runs
        self.order: list[str] = []  # job ids in submission order; rules pick one by index

    @initialize(max_attempts=st.lists(st.integers(1, 3), min_size=2, max_size=4))
    def first_jobs(self, max_attempts: list[int]) -> None:
        with self.db.session() as s:
            s.execute(delete(Job))
        for n in max_attempts:
            self.submit(n, dispatched=True)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _job(self, index: int) -> str:
        return self.order[index % len(self.order)]

    def _claimable_job(self, index: int) -> str:
        """Mostly a job a claim could take (queued, or running on a lapsed lease), else any job (a duplicate)."""
        open_ = [j for j in self.order if self.model[j].status == JobStatus.QUEUED or self.model[j].expired]
        if open_ and index % 4:
            return open_[index % len(open_)]
        return self._job(index)

    def _worker_job(self, worker: str, index: int) -> str:
        """Mostly one of the jobs `worker` believes it runs (held or lost since), else any job."""
        mine = sorted(self.inflight[worker])
        if mine and index % 4:
            return mine[index % len(mine)]
        return self._job(index)

    def _held(self, job_id: str, worker: str) -> bool:
        m = self.model[job_id]
        return m.status == JobStatus.RUNNING and m.owner == worker

    def _expire(self, worker: str) -> None:
        """`worker`'s leases run out: lease_until moves into the past for the jobs it runs."""
        past = utcnow() - timedelta(hours=1)
        with self.db.session() as s:
            s.execute(
                update(Job)
                .where(Job.id.in_(list(self.model)), Job.status == JobStatus.RUNNING, Job.lease_owner == worker)
                .values(lease_until=past)
            )
        for m in self.model.values():
            if m.status == JobStatus.RUNNING and m.owner == worker:
                m.expired = True

    # -- the one rule ----------------------------------------------------------------------------------------------

    @rule(action=st.sampled_from(ACTIONS), job=JOB, worker=st.sampled_from(WORKERS), flag=st.booleans())
    def step(self, action: str, job: int, worker: str, flag: bool) -> None:
        """One action; `job` picks a job by index, `flag` is submit's `dispatched` and a lapsed worker's death."""
        match action:
            case "submit":
                self.submit(1 + job % 3, dispatched=flag)
            case "claim" | "finish" | "fail" | "release":
                getattr(self, action)(job, worker)
            case "heartbeat":
                self.heartbeat(worker)
            case "leases_run_out":
                self.leases_run_out(worker, dies=flag)
            case "reap":
                self.reap()
            case "cancel":
                self.cancel(job)
            case _:
                raise AssertionError(action)

    # -- actions -------------------------------------------------------------------------------------------------

    def submit(self, max_attempts: int, dispatched: bool) -> None:
        with self.db.session() as s:
            job = jobs.create_job(s, model="m", request=REQUEST, max_attempts=max_attempts, dispatched=dispatched)
            job_id = job.id
        self.model[job_id] = ModelJob(max_attempts=max_attempts, dispatched=dispatched)
        self.order.append(job_id)

    def claim(self, job: int, worker: str) -> None:
        job_id = self._claimable_job(job)
        m = self.model[job_id]
        claimable = m.status == JobStatus.QUEUED or (m.status == JobStatus.RUNNING and m.expired)
        expected = claimable and m.attempts < m.max_attempts
        with self.db.session() as s:
            row = jobs.claim(s, job_id, worker, LEASE_SECONDS)
            got = None if row is None else (row.status, row.lease_owner, row.attempts)
        if not expected:
            assert got is None, f"claim of {m} by {worker} should be refused, got {got}"
            return
        assert got == (JobStatus.RUNNING, worker, m.attempts + 1), f"claim of {m} by {worker} gave {got}"
        m.status, m.owner, m.attempts, m.expired = JobStatus.RUNNING, worker, m.attempts + 1, False
        self.inflight[worker].add(job_id)

    def heartbeat(self, worker: str) -> None:
        """The worker asks which of its jobs it still runs, then extends those leases."""
        ids = sorted(self.inflight[worker])
        still_held = {j for j in ids if self._held(j, worker)}
        with self.db.session() as s:
            assert jobs.held_by(s, ids, worker) == still_held
        with self.db.session() as s:
            count = jobs.heartbeat(s, ids, worker, LEASE_SECONDS)
        assert count == len(still_held)
        for j in still_held:
            self.model[j].expired = False

    def finish(self, job: int, worker: str) -> None:
        job_id = self._worker_job(worker, job)
        m = self.model[job_id]
        expected = self._held(job_id, worker)
        result = jobs.JobResult(f"results/{job_id}.json", f"by {worker}", "stop", 7, 2)
        with self.db.session() as s:
            ok = jobs.finish(s, job_id, worker, result)
        if ok:
            m.accepted_finishes.append(worker)
        assert len(m.accepted_finishes) <= 1, f"{job_id} accepted two results: {m.accepted_finishes}"
        assert ok == expected, f"finish of {m} by {worker}: {ok}"
        self.inflight[worker].discard(job_id)
        if ok:
            m.status, m.expired = JobStatus.SUCCEEDED, False

    def fail(self, job: int, worker: str) -> None:
        job_id = self._worker_job(worker, job)
        m = self.model[job_id]
        expected = self._held(job_id, worker)
        with self.db.session() as s:
            ok = jobs.fail(s, job_id, worker, "bad_image", "cannot decode")
        assert ok == expected, f"fail of {m} by {worker}: {ok}"
        self.inflight[worker].discard(job_id)
        if ok:
            m.status, m.expired = JobStatus.FAILED, False

    def release(self, job: int, worker: str) -> None:
        job_id = self._worker_job(worker, job)
        m = self.model[job_id]
        if not self._held(job_id, worker):
            expected = None
        elif m.attempts >= m.max_attempts:
            expected = JobStatus.DEAD
        else:
            expected = JobStatus.QUEUED
        with self.db.session() as s:
            got = jobs.release(s, job_id, worker, "engine_error", "transient")
        assert got == expected, f"release of {m} by {worker}: {got}"
        self.inflight[worker].discard(job_id)
        if got is not None:
            m.status, m.owner, m.expired = got, None, False

    def leases_run_out(self, worker: str, dies: bool) -> None:
        """The worker crashes (and forgets what it ran) or stalls past its leases (and may still try to finish)."""
        self._expire(worker)
        if dies:
            self.inflight[worker].clear()

    def reap(self) -> None:
        expected: dict[str, set[str]] = {JobStatus.QUEUED: set(), JobStatus.DEAD: set()}
        for job_id, m in self.model.items():
            if m.status == JobStatus.RUNNING and m.expired:
                expected[JobStatus.DEAD if m.attempts >= m.max_attempts else JobStatus.QUEUED].add(job_id)
        with self.db.session() as s:
            outcome = jobs.reap(s)
        assert {k: set(v) for k, v in outcome.items()} == expected
        for status, ids in expected.items():
            for job_id in ids:
                m = self.model[job_id]
                m.status, m.owner, m.expired = status, None, False
                if status == JobStatus.QUEUED:
                    m.dispatched = False  # its message died with the worker: dispatch must send it again

    def cancel(self, job: int) -> None:
        job_id = self._job(job)
        m = self.model[job_id]
        expected = m.status in (JobStatus.QUEUED, JobStatus.RUNNING)
        with self.db.session() as s:
            ok = jobs.cancel(s, job_id)
        assert ok == expected, f"cancel of {m}: {ok}"
        if ok:
            m.status, m.owner, m.expired = JobStatus.CANCELLED, None, False

    # -- invariants, against the rows ----------------------------------------------------------------------------

    @invariant()
    def rows_match_model_and_invariants(self) -> None:
        with self.db.session() as s:
            rows = {job.id: job for job in s.scalars(select(Job))}
        assert set(rows) == set(self.model)
        now = utcnow()
        for job_id, job in rows.items():
            m = self.model[job_id]
            assert job.status in KNOWN_STATUSES, job.status
            assert len(m.accepted_finishes) <= 1, f"{job_id} accepted two results: {m.accepted_finishes}"
            assert job.attempts <= job.max_attempts, (job.attempts, job.max_attempts)
            if job_id in self.seen_terminal:
                assert job.status == self.seen_terminal[job_id], f"{job_id} left {self.seen_terminal[job_id]}"
            elif job.status in TERMINAL_STATUSES:
                self.seen_terminal[job_id] = job.status
            assert (job.status, job.attempts) == (m.status, m.attempts), (job_id, job.status, job.attempts, m)
            if job.status == JobStatus.RUNNING:
                assert job.lease_owner == m.owner and job.lease_owner is not None
                assert job.lease_until is not None
                assert (job.lease_until < now) == m.expired
            if job.status == JobStatus.QUEUED:
                assert job.lease_owner is None and job.lease_until is None
                assert (job.dispatched_at is not None) == m.dispatched
            if job.status in TERMINAL_STATUSES:
                assert job.lease_until is None and job.finished_at is not None
            if job.status == JobStatus.SUCCEEDED:
                assert len(m.accepted_finishes) == 1
                assert job.result_text == f"by {m.accepted_finishes[0]}"
                assert job.result_key == f"results/{job_id}.json"
                assert job.error_code is None and job.error_message is None  # a released attempt's error is gone
            else:
                assert job.result_key is None and not m.accepted_finishes


def test_job_state_machine(db: Database) -> None:
    """Derandomized, so CI runs the same sequences every time; each example starts from an empty jobs table."""
    run_state_machine_as_test(
        lambda: JobStateMachine(db),  # type: ignore[arg-type]
        settings=settings(
            max_examples=80,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
