"""Keeps the leases of every job this worker holds alive while they wait for and run on the model, and stops the
ones it no longer holds.

A job this worker runs may be cancelled in SQL (a batch's cancel or expiry, a single job's cancel) or, after a
stall, taken over by another worker. Every heartbeat finds such jobs; so does a check, one read and no write,
asked for by `check_soon` whenever there is reason to think one was: the cancel path tells every worker
(worker/tasks.py), and a finish refused here hints that others may be too. Each job found is let go and handed
to `on_lost`, which aborts its generation, so it stops holding an engine slot and KV blocks as soon as the
worker learns of it rather than at the next heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from common.domain import jobs
from common.infra.db import Database

log = logging.getLogger(__name__)

# Checks asked for in quick succession (a burst of refused finishes, several cancels) run at most this often.
MIN_CHECK_GAP_SECONDS = 0.2


class LeaseKeeper:
    def __init__(self, db: Database, worker_id: str, lease_seconds: float, interval_seconds: float,
                 on_lost: Callable[[str], None] | None = None,
                 min_check_gap_seconds: float = MIN_CHECK_GAP_SECONDS) -> None:
        self.db = db
        # Called with each job this worker no longer holds (cancelled, or its lease taken over), so its
        # generation can stop instead of running to the end for a result nobody will accept.
        self.on_lost = on_lost
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval_seconds = interval_seconds
        self.min_check_gap_seconds = min_check_gap_seconds
        self._held: dict[str, str | None] = {}  # job id -> its batch
        self._batch_rows: dict[str, int] = {}  # batch id -> jobs of it held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._check_asked = threading.Event()
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
        return self._pop(job_id)[1]

    def _pop(self, job_id: str) -> tuple[bool, bool]:
        """(whether the job was held, whether it was the last of its batch held)."""
        with self._lock:
            if job_id not in self._held:
                return False, False
            batch_id = self._held.pop(job_id)
            if batch_id is None:
                return True, False
            left = self._batch_rows[batch_id] - 1
            if left:
                self._batch_rows[batch_id] = left
                return True, False
            del self._batch_rows[batch_id]
            return True, True

    def holds(self, job_id: str) -> bool:
        """Whether the job is still this worker's, as far as it knows: no SQL, so cheap enough to ask before each
        step of a job's work (a job found lost is let go here at once)."""
        with self._lock:
            return job_id in self._held

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
        self._let_go(lost)
        return extended

    def check(self) -> int:
        """Report the jobs this worker no longer holds to `on_lost`, with one read and no lease written; returns
        how many it found."""
        job_ids = self.held()
        if not job_ids:
            return 0
        with self.db.session() as session:
            lost = set(job_ids) - jobs.held_by(session, job_ids, self.worker_id)
        return self._let_go(lost)

    def check_soon(self) -> None:
        """Have the heartbeat thread `check` now rather than at its next beat. Never blocks."""
        self._check_asked.set()

    def _let_go(self, lost: set[str]) -> int:
        """Let go of the lost jobs still held and report each to `on_lost`; one that ended here meanwhile (its
        own finish, refused or not) needs no abort."""
        reported = 0
        for job_id in sorted(lost):
            if not self._pop(job_id)[0]:
                continue
            reported += 1
            if self.on_lost is not None:
                self.on_lost(job_id)
        return reported

    def _loop(self) -> None:
        next_beat = time.monotonic() + self.interval_seconds
        while True:
            asked = self._check_asked.wait(max(0.0, next_beat - time.monotonic()))
            if self._stop.is_set():
                return
            self._check_asked.clear()
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval_seconds
                    self.beat()  # finds the lost jobs too
                elif asked and (lost := self.check()):
                    log.info("%d jobs this worker ran were cancelled or taken over; stopped", lost)
            except Exception:  # a database blip must not kill the heartbeat thread
                log.exception("heartbeat failed")
            if asked and self._stop.wait(self.min_check_gap_seconds):
                return

    def close(self) -> None:
        self._stop.set()
        self._check_asked.set()
        self._thread.join(5)
