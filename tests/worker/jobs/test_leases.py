"""The heartbeat keeps held leases alive and reports jobs the worker lost (cancelled, taken over)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
