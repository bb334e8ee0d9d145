"""Decoded pixels a worker's job threads may hold at once while they prepare jobs' inputs.

A job's images arrive compressed: 16 solid-colour 6000x6000 PNGs are 2 MB, decoded 1.7 GB, and the processor's
copies multiply that. Sixty-four job threads preparing at once would
take the worker down, and every tenant's jobs in it. So each job first reads its images' sizes from their
headers, waits here until its pixels fit beside those already held, and gives them back once its inputs are
prepared. Waiters are served in arrival order, so a large job is not passed over for ever by small ones; a job
larger than the whole budget runs when nothing else is held.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class PixelBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_held = 0
        self._waiting: deque[int] = deque()
        self._tickets = itertools.count()
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        if pixels <= 0:
            yield
            return
        with self._changed:
            ticket = next(self._tickets)
            self._waiting.append(ticket)
            try:
                while not (self._waiting[0] == ticket and self._fits(pixels)):
                    self._changed.wait()
            finally:
                self._waiting.remove(ticket)
                self._changed.notify_all()
            self.num_held += pixels
        try:
            yield
        finally:
            with self._changed:
                self.num_held -= pixels
                self._changed.notify_all()

    def _fits(self, pixels: int) -> bool:
        return self.num_held == 0 or self.num_held + pixels <= self.capacity
