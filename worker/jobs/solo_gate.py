"""Jobs on their last attempt run alone in the worker.

A job that crashes its process (a native fault on some input) takes every job in flight beside it down too,
and each of them loses an attempt. Running a job's last attempt alone bounds that: a poison job dies by
itself, and the jobs that crashed with it get a last attempt it cannot spoil. Last attempts are rare (a job
lost twice), so the throughput they cost is small.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SoloGate:
    """A readers-writer lock with the writer first: shared runs wait while a solo run waits or runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_shared = 0
        self._num_solo_waiting = 0
        self._solo_running = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._solo_running or self._num_solo_waiting:
                self._cond.wait()
            self._num_shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_shared -= 1
                self._cond.notify_all()

    @contextmanager
    def solo(self) -> Iterator[None]:
        with self._cond:
            self._num_solo_waiting += 1
            while self._solo_running or self._num_shared:
                self._cond.wait()
            self._num_solo_waiting -= 1
            self._solo_running = True
        try:
            yield
        finally:
            with self._cond:
                self._solo_running = False
                self._cond.notify_all()
