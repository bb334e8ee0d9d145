"""Coalescing of idempotent follow-up work that many threads ask for at once, such as a dispatch top-up after
each job ends: one thread runs it, and the others only ask for one more run after it.

When the engine ends 64 jobs in one step, 64 task threads would each run the same top-up (two queries and a
commit) to learn the same thing. The work is a function of the database's state, not of which job asked, so
one run that starts after the last request covers all of them: a request that arrives while a run is in
progress marks the key, and the running thread goes round again. No request is ever dropped: the last run
always starts after the last request was made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class Coalescer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()
        self.num_runs = 0  # runs of any key (tests read it)

    def run(self, key: Hashable, work: Callable[[], object]) -> bool:
        """Run `work` now, or, when another thread is running the work of `key`, have that thread run it once
        more and return at once. True when this thread ran it. Errors of `work` propagate to the thread that
        ran it; the key is free again afterwards."""
        with self._lock:
            if key in self._running:
                self._again.add(key)
                return False
            self._running.add(key)
        try:
            while True:
                self.num_runs += 1
                work()
                with self._lock:
                    if key not in self._again:
                        self._running.discard(key)
                        return True
                    self._again.discard(key)
        except BaseException:
            with self._lock:
                self._running.discard(key)
                self._again.discard(key)
            raise
