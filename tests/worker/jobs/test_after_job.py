"""worker/jobs/after_job.py: a batch's finalize check runs once per interval while its jobs end, and at once
after the last job of it that this worker held."""

from __future__ import annotations

import time

import pytest

from common.domain.models import JobStatus
from common.infra.db import Database
from common.infra.debounce import Debouncer
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from tests.worker.batches.test_ingest import Recorder, _finish, batch_jobs, line, make_batch, settings
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.jobs import after_job as after_job_module
from worker.jobs.after_job import AfterJobDeps, after_job
from worker.jobs.pipeline import Outcome

__all__ = ["settings"]  # test_ingest's, with the db and store tests/worker/conftest.py makes of it


def test_the_last_job_a_worker_held_of_a_batch_checks_at_once(settings: Settings, db: Database, store: ObjectStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    debouncer = Debouncer(interval=30.0)  # a plain request after the first waits out the whole test
    monkeypatch.setattr(after_job_module, "_after_job_work", debouncer)
    batch_id = make_batch(db, store, "\n".join([line("one"), line("two")]).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    first, second = batch_jobs(db, batch_id)
    finalized: list[str] = []
    deps = AfterJobDeps(db, dispatch_window=10, send_jobs=lambda model, job_ids, priority: 0,
                        send_finalize=finalized.append)

    def ended(job_id: str, drained: bool) -> None:
        after_job(deps, job_id, Outcome(JobStatus.SUCCEEDED, tenant=first.tenant, model=first.model,
                                        batch_id=batch_id, batch_drained=drained))

    _finish(db, store, first, "one")
    ended(first.id, drained=False)
    assert debouncer.wait_idle(5)  # the batch's first check ran at once, and found a job open
    assert finalized == []
    _finish(db, store, second, "two")
    ended(second.id, drained=False)  # another worker still holds jobs of the batch: the check waits
    assert not debouncer.wait_idle(0.5)
    assert finalized == []
    ended(second.id, drained=True)  # the dispatch top-up still waits out its interval; the check does not
    deadline = time.monotonic() + 5
    while not finalized and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finalized == [batch_id]


def test_ended_jobs_counts_only_watched_batches() -> None:
    """`vlmq run`'s progress counts its batch's ended jobs; a long-lived worker, which watches none, keeps
    nothing per batch."""
    from worker.jobs.after_job import EndedJobs

    ended = EndedJobs()
    ended.add("batch_a", JobStatus.SUCCEEDED)  # not watched: not kept
    ended.watch("batch_a")
    ended.add("batch_a", JobStatus.SUCCEEDED)
    ended.add("batch_a", JobStatus.FAILED)
    ended.add("batch_b", JobStatus.SUCCEEDED)
    assert ended.of("batch_a") == {JobStatus.SUCCEEDED: 1, JobStatus.FAILED: 1}
    assert ended.of("batch_b") == {}
    ended.unwatch("batch_a")
    ended.add("batch_a", JobStatus.SUCCEEDED)
    assert ended.of("batch_a") == {} and not ended._counts
