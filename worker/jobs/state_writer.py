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

from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.infra.db import Database
from common.infra.group_commit import GroupCommitter

# How long a group waits after its first request for others. Without it, the writer thread wakes for each
# request the moment it is queued and groups stay at one or two, while a claim costs far less CPU a job in a
# larger group (bench/compare.py, side by side); the wait is short beside the jobs it delays.
LINGER_SECONDS = 0.003


@dataclass(slots=True)
class _Ask:
    job_id: str
    result: jobs.JobResult | None  # None: a claim


# A claim's answer is its claimed job (None: not taken); a finish's, whether the job was finished.
_Answer = ClaimedJob | bool | None


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
        self.num_transactions = 0  # transactions written, grouped or alone (tests and metrics read it)
        # Not cancellable: no caller cancels a claim or a finish, and the hot path pays for no state change.
        self.committer: GroupCommitter[_Ask, _Answer] = GroupCommitter(
            "state writer", self._write, self._write_one, max_group=max_group, linger_seconds=linger_seconds,
            cancellable=False, thread_name="vlmq-state-writer")

    def claim(self, job_id: str) -> ClaimedJob | None:
        """common.domain.jobs.claim(..., unless_last_try=True) of this one job, grouped with other threads' claims."""
        return _claimed(self.committer.submit(_Ask(job_id, None)).result())

    def claim_all(self, job_ids: list[str]) -> dict[str, ClaimedJob | Exception | None]:
        """`claim` of each job, asked for together so that they share a group: a chunk's claim. Each id maps to
        its claimed job, None (someone else holds it, it has ended, or this is its last try) or the error its
        claim met."""
        asks = self.committer.submit_all(_Ask(job_id, None) for job_id in dict.fromkeys(job_ids))
        answers: dict[str, ClaimedJob | Exception | None] = {}
        for ask in asks:
            error = ask.exception()
            answers[ask.item.job_id] = error if isinstance(error, Exception) else _claimed(ask.result())
        return answers

    def finish(self, job_id: str, result: jobs.JobResult) -> bool:
        """common.domain.jobs.finish of this one job, grouped with other threads' finishes."""
        return bool(self.committer.submit(_Ask(job_id, result)).result())

    def finish_later(self, job_id: str, result: jobs.JobResult) -> Future[bool]:
        """`finish` without waiting: the future answers whether the job was finished, on the writer's thread
        (callbacks added to it run there, so they must not block). Raises RuntimeError once closed."""
        return cast("Future[bool]", self.committer.submit(_Ask(job_id, result)))

    def close(self, timeout: float = 10.0) -> None:
        """Write what was asked for, then stop; later requests are refused (RuntimeError)."""
        self.committer.close(timeout)
        if self._own_db:
            self.db.dispose()

    def _write(self, group: list[_Ask]) -> list[_Answer]:
        """The group in one transaction: one UPDATE for its claims, one for its finishes."""
        claim_ids = sorted({ask.job_id for ask in group if ask.result is None})
        finishes = {ask.job_id: ask.result for ask in group if ask.result is not None}
        # A plain connection: the grouped statements are Core, and a session's bookkeeping is CPU for nothing.
        with self.db.engine.begin() as connection:
            claimed = jobs.claim_many(connection, claim_ids, self.worker_id, self.lease_seconds)
            finished = jobs.finish_many(connection, self.worker_id, finishes)
        self.num_transactions += 1
        # Two deliveries of the same job in one group: the claim went to the first of them only.
        taken: set[str] = set()
        answers: list[_Answer] = []
        for ask in group:
            if ask.result is None:
                answers.append(claimed.get(ask.job_id) if ask.job_id not in taken else None)
                taken.add(ask.job_id)
            else:
                answers.append(ask.job_id in finished)
        return answers

    def _write_one(self, ask: _Ask) -> _Answer:
        with self.db.session() as session:
            self.num_transactions += 1
            if ask.result is None:
                job = jobs.claim(session, ask.job_id, self.worker_id, self.lease_seconds, unless_last_try=True)
                return None if job is None else ClaimedJob.of(job)
            return jobs.finish(session, ask.job_id, self.worker_id, ask.result)


def _claimed(answer: _Answer) -> ClaimedJob | None:
    """A claim's answer, typed as one (a claim never answers a bool)."""
    return answer if isinstance(answer, ClaimedJob) else None
