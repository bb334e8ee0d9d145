"""The heartbeat keeps held leases alive and reports jobs the worker lost (cancelled, taken over)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from common.domain import jobs
from common.domain.models import Job, utcnow
from common.infra.db import Database
from common.infra.migrate import upgrade
from worker.jobs.leases import LeaseKeeper

REQUEST: dict[str, Any] = {"messages": [], "sampling": {}}


def test_beat_extends_held_and_reports_cancelled(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    db = Database(url)
    with db.session() as s:
        kept, cancelled, stolen = (jobs.create_job(s, model="m", request=REQUEST).id for _ in range(3))
    with db.session() as s:
        for job_id in (kept, cancelled, stolen):
            jobs.claim(s, job_id, "w1", 5)
    lost: list[str] = []
    keeper = LeaseKeeper(db, "w1", lease_seconds=600, interval_seconds=3600, on_lost=lost.append)
    try:
        for job_id in (kept, cancelled, stolen):
            keeper.add(job_id)
        with db.session() as s:
            jobs.cancel(s, cancelled)
            taken = s.get(Job, stolen)
            assert taken is not None
            taken.lease_owner = "w2"  # another worker took it over after a lease expiry
        assert keeper.beat() == 1
        assert sorted(lost) == sorted([cancelled, stolen])
        assert keeper.held() == [kept]
        with db.session() as s:
            held = s.get(Job, kept)
            assert held is not None
            lease = held.lease_until
        assert lease is not None and (lease - utcnow()).total_seconds() > 500
    finally:
        keeper.close()
        db.dispose()


def test_discard_says_when_the_last_held_job_of_a_batch_is_let_go(tmp_path: Path) -> None:
    keeper = LeaseKeeper(Database(f"sqlite:///{tmp_path / 'db.sqlite'}"), "w1", lease_seconds=600,
                         interval_seconds=3600)
    try:
        keeper.add("a1", "batch-a")
        keeper.add("a2", "batch-a")
        keeper.add("a2", "batch-a")  # held already: counted once
        keeper.add("b1", "batch-b")
        keeper.add("solo")  # a single job: no batch
        assert keeper.discard("solo") is False
        assert keeper.discard("a1") is False  # a2 of the same batch is still held
        assert keeper.discard("b1") is True
        assert keeper.discard("a2") is True
        assert keeper.discard("a2") is False  # let go already
        keeper.add("a3", "batch-a")  # the batch's rows may come back to this worker later
        assert keeper.discard("a3") is True
        assert keeper.held() == []
    finally:
        keeper.close()


def test_check_soon_stops_lost_jobs_at_once_without_writing_leases(tmp_path: Path) -> None:
    """A cancel tells the workers (or a refused finish hints) that held jobs may be gone: the keeper looks now,
    not at its next beat (an hour away here), with a read only, and reports each lost job once."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    db = Database(url)
    with db.session() as s:
        kept, cancelled = (jobs.create_job(s, model="m", request=REQUEST).id for _ in range(2))
    with db.session() as s:
        for job_id in (kept, cancelled):
            jobs.claim(s, job_id, "w1", 60)
    lease = _lease(db, kept)
    lost: list[str] = []
    keeper = LeaseKeeper(db, "w1", lease_seconds=600, interval_seconds=3600, on_lost=lost.append,
                         min_check_gap_seconds=0)
    try:
        keeper.add(kept, "batch-a")
        keeper.add(cancelled, "batch-a")
        keeper.check_soon()  # nothing lost yet: a look that changes nothing
        with db.session() as s:
            jobs.cancel(s, cancelled)
        keeper.check_soon()
        deadline = time.monotonic() + 10
        while not lost:
            assert time.monotonic() < deadline, "the keeper did not look when asked"
            time.sleep(0.01)
        assert lost == [cancelled] and keeper.held() == [kept]
        assert not keeper.holds(cancelled) and keeper.holds(kept)
        assert keeper.check() == 0 and lost == [cancelled]  # let go already: reported once
        assert _lease(db, kept) == lease  # a check writes no lease
        assert keeper.discard(kept) is True  # the batch's last row held here
    finally:
        keeper.close()
        db.dispose()


def test_a_lost_job_that_ended_meanwhile_is_not_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose own end let it go between the keeper's look and its report needs no abort."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    db = Database(url)
    with db.session() as s:
        job_id = jobs.create_job(s, model="m", request=REQUEST).id
    lost: list[str] = []
    keeper = LeaseKeeper(db, "w1", lease_seconds=600, interval_seconds=3600, on_lost=lost.append)
    try:
        keeper.add(job_id)
        held_by = jobs.held_by

        def ended_meanwhile(*args: Any) -> set[str]:
            keeper.discard(job_id)  # the job's own finish, refused, let it go while the keeper read
            return held_by(*args)

        monkeypatch.setattr(jobs, "held_by", ended_meanwhile)
        assert keeper.check() == 0
        assert lost == []
    finally:
        keeper.close()
        db.dispose()


def _lease(db: Database, job_id: str) -> object:
    with db.session() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.lease_until
