"""The in-process broker of embedded mode (memory://), made quick to stop.

Celery's consumer loop for this transport (celery.worker.loops.synloop) looks for a stop request only between
drains, and asks for drains of up to two seconds: an idle embedded worker took that long to notice the stop
at the end of every `vlmq run`, with nothing left to do. Here a drain waits in short slices and gives up early
once a stop has been asked for, so the loop comes round to see it; any other drain waits as long as it asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state
from kombu.transport import memory

# How often a waiting drain looks for a stop request.
SLICE_SECONDS = 0.05


class Transport(memory.Transport):
    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        drain: Callable[..., Any] = super().drain_events  # kombu's, untyped
        if timeout is None:
            return drain(connection, timeout=timeout, **kwargs)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return drain(connection, timeout=max(0.0, min(SLICE_SECONDS, remaining)), **kwargs)
            except TimeoutError:
                if remaining <= SLICE_SECONDS or worker_state.should_terminate is not None:
                    raise
