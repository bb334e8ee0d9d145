"""Keeps the leases of every job this worker holds alive while they wait for and run on the model."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from common.domain import jobs
from common.infra.db import Database

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, db: Database, worker_id: str, lease_seconds: float, interval_seconds: float,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.db = db
        # Called with each job this worker no longer holds (cancelled, or its lease taken over), so its
        # generation can stop instead of running to the end for a result nobody will accept.
        self.on_lost = on_lost
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval_seconds = interval_seconds
        self._held: dict[str, str | None] = {}  # job id -> its batch
        self._batch_rows: dict[str, int] = {}  # batch id -> jobs of it held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlmq-heartbeat", daemon=True)
        self._thread.start()

    def add(self, job_id: str, batch_id: str | None = None) -> None:
        with self._lock:
            if job_id in self._held:
                return
            self._held[job_id] = batch_id
            if batch_id is not None:
                self._batch_rows[batch_id] = self._batch_rows.get(batch_id, 0) + 1

    def discard(self, job_id: str) -> bool:
        """Let the job's lease go. True when it was the last job of its batch this worker held: the batch may
        be done, so its finalize check should not wait (worker/jobs/after_job.py)."""
        with self._lock:
            if job_id not in self._held:
                return False
            batch_id = self._held.pop(job_id)
            if batch_id is None:
                return False
            left = self._batch_rows[batch_id] - 1
            if left:
                self._batch_rows[batch_id] = left
                return False
            del self._batch_rows[batch_id]
            return True

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def beat(self) -> int:
        """Extend the leases still held; report the others to `on_lost`. Returns how many are still held."""
        job_ids = self.held()
        if not job_ids:
            return 0
        with self.db.session() as session:
            extended = jobs.heartbeat(session, job_ids, self.worker_id, self.lease_seconds)
            lost = set(job_ids) - jobs.held_by(session, job_ids, self.worker_id) if extended < len(job_ids) else set()
        for job_id in sorted(lost):
            self.discard(job_id)
            if self.on_lost is not None:
                self.on_lost(job_id)
        return extended

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.beat()
            except Exception:  # a database blip must not kill the heartbeat thread
                log.exception("heartbeat failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
