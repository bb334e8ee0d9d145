"""Debounced follow-up work: idempotent work that many threads ask for (a dispatch top-up, a batch-finalize
check after each job ends) runs on one background thread, at most once per `interval` for each key, and
always once more after the last request.

The work is a function of the database's state, not of which job asked, so one run that starts after the
last request covers every request before it. Run in each job's own thread, the after-job top-up and finalize
check cost two queries and a commit per job, under the GIL the engine's thread waits for, and held back a
tiny-model worker's throughput (bench/compare.py, ablated side by side). Once per interval per key, its cost
does not grow with the job rate; a window refill waits at most `interval`.

A request that arrives while its key's run is in progress schedules one more run, no earlier than `interval`
after that run started: no request is ever dropped. A request made `now` is due at once, interval or not: its
caller knows this run is the one that matters (a worker's last job of a batch, whose finalize check would
otherwise wait out the interval after the batch's end). Errors are logged; the key is free again afterwards. A
run still pending when the process dies is lost with it, which the callers' periodic sweep covers. A forked
child gets a debouncer of its own, empty, whose thread starts on its first request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

_debouncers: weakref.WeakSet[Debouncer] = weakref.WeakSet()


class Debouncer:
    def __init__(self, interval: float, name: str = "vlmq-debounce") -> None:
        self.interval = interval
        self.name = name
        self._cond = threading.Condition()
        # key -> (when it is due, the latest work asked for); the heap may also hold stale entries of a key that
        # was asked for again sooner, which are skipped.
        self._pending: dict[Hashable, tuple[float, Callable[[], object]]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []  # (due, tie-breaker, key) of each pending key
        self._order = itertools.count()
        self._last_start: dict[Hashable, float] = {}
        self._busy = False  # a run is in progress
        self._thread: threading.Thread | None = None
        _debouncers.add(self)

    def _after_fork_in_child(self) -> None:
        # A forked child has none of the parent's threads, and may have forked while one held the lock: it
        # starts afresh (the parent's pending runs are the parent's).
        self._cond = threading.Condition()
        self._pending.clear()
        self._heap.clear()
        self._last_start.clear()
        self._busy = False
        self._thread = None

    def request(self, key: Hashable, work: Callable[[], object], now: bool = False) -> bool:
        """Have `work` run on the background thread, at once when `key` last ran `interval` ago or more, or
        with `now`. False when a pending run of `key` already covers this request (it will run this `work`,
        sooner where `now` asks for it)."""
        with self._cond:
            at = time.monotonic()
            due = at if now else max(at, self._last_start.get(key, float("-inf")) + self.interval)
            pending = self._pending.get(key)
            if pending is not None and pending[0] <= due:
                self._pending[key] = (pending[0], work)
                return False
            self._pending[key] = (due, work)
            heapq.heappush(self._heap, (due, next(self._order), key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return pending is None

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Until nothing is pending or running (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                key, work = self._next_due()
                self._busy = True
                now = time.monotonic()
                self._last_start[key] = now
                # Keys idle for an interval no longer delay anything: forget them, so the map stays small.
                for old in [k for k, started in self._last_start.items() if now - started > self.interval]:
                    del self._last_start[old]
            try:
                work()
            except Exception:
                log.exception("follow-up work %r failed", key)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _next_due(self) -> tuple[Hashable, Callable[[], object]]:
        """Blocks (holding the condition) until the earliest pending key is due; pops it."""
        while True:
            if not self._heap:
                self._cond.wait()
                continue
            due, _, key = self._heap[0]
            pending = self._pending.get(key)
            if pending is None or pending[0] != due:
                heapq.heappop(self._heap)  # stale: the key ran already, or was asked for sooner
                continue
            delay = due - time.monotonic()
            if delay > 0:
                self._cond.wait(delay)
                continue
            heapq.heappop(self._heap)
            return key, self._pending.pop(key)[1]


def _reset_after_fork() -> None:
    for debouncer in list(_debouncers):
        debouncer._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_after_fork)
