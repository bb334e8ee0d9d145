"""Group commit for POST /v1/jobs: the jobs that arrive while one transaction is being written go into the
next one, with their run_job messages sent in one Redis round trip after its commit.

Per job, a commit costs a WAL flush and a round trip on the database, a session and a connection checkout on
our side, and a thread-pool hand-off per request: together a large share of a submission's CPU (bench/ingest.py).
Batching needs no timer: under load, requests pile up while a write is in progress, so batches grow with the
load and a lone request is written at once. A request's answer still comes only after its job is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from functools import partial

from sqlalchemy.exc import InterfaceError, OperationalError

from api.deps import AppState
from common.broker import dispatch
from common.broker.queue import send_run_jobs
from common.domain import jobs
from common.domain.views import job_view
from common.infra.group_commit import GroupCommitter

log = logging.getLogger(__name__)

# The database itself is unreachable: writing the group's requests one by one would only fail them slower.
_UNREACHABLE = (OperationalError, InterfaceError)


def _retry_alone(num_jobs: int, error: Exception) -> bool:
    """One request's value the database refused (or a bug it alone meets) must not fail the requests that
    happened to share its transaction: each is written on its own instead. A lone request is not written
    twice."""
    return num_jobs > 1 and not isinstance(error, _UNREACHABLE)


class JobWriter:
    def __init__(self, state: AppState, max_batch: int = 512) -> None:
        self.state = state
        # The thread starts with the first request: an app that is built and never serves starts none.
        self.committer: GroupCommitter[jobs.NewJob, str] = GroupCommitter(
            "job writer", self._write, self._write_alone, retry_alone=_retry_alone, max_group=max_batch,
            thread_name="vlmq-job-writer")

    async def write(self, fields: jobs.NewJob) -> str:
        """Commit a new queued job and dispatch it; its JSON view. A request whose client goes away before
        its group is taken is not written (it was never answered 202)."""
        return await asyncio.wrap_future(self.committer.submit(fields))

    def close(self) -> None:
        self.committer.close()

    def _write(self, batch: list[jobs.NewJob]) -> list[str]:
        """Insert the jobs in one transaction, then send their messages; their JSON views."""
        with self.state.db.session() as session:
            made = [fields.job() for fields in batch]
            session.add_all(made)
            session.flush()
            views = [(job.id, job.priority, job_view(job).model_dump_json()) for job in made]
        # Never raises (a send that fails marks its jobs unsent for the sweep), so a committed group is never
        # written again one by one.
        self._send(views)
        return [view for _, _, view in views]

    def _write_alone(self, fields: jobs.NewJob) -> str:
        return self._write([fields])[0]

    def _send(self, views: list[tuple[str, int, str]]) -> None:
        by_priority: dict[int, list[str]] = defaultdict(list)
        for job_id, priority, _ in views:
            by_priority[priority].append(job_id)
        for priority, job_ids in by_priority.items():
            dispatch.send_or_mark_unsent(self.state.db, job_ids, partial(
                send_run_jobs, self.state.celery, self.state.settings, job_ids, priority))
