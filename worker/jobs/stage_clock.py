"""CPU time the worker's job threads spend in each stage of a job, for /metrics and the benchmarks.

On a small host the worker's Python is what paces the service: every job's claim, inputs, template and tokens,
result object and finish run under one GIL. The process's total CPU says how much; this says where. It counts
the calling thread's CPU (`time.thread_time`), so waiting (on SQL, S3, the engine, the GIL) costs nothing here,
and a stage's cost is its own work, not the load around it. A grouped claim's or finish's SQL runs on the state
writer's thread, so those stages count only the hand-off; the writer's own work is in the process's total.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

STAGES = ("claim", "inputs", "prepare", "engine", "persist", "finish")


@dataclass
class StageClock:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def stage(self, name: str, calls: int = 1) -> Iterator[None]:
        """`calls`: how many jobs the stage served at once (a chunk's claim serves all its rows)."""
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._lock:
                self.seconds[name] = self.seconds.get(name, 0.0) + spent
                self.calls[name] = self.calls.get(name, 0) + calls

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """Per stage: (CPU seconds, calls) so far."""
        with self._lock:
            return {name: (self.seconds[name], self.calls[name]) for name in self.seconds}
