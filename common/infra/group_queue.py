"""The draining step of a group-commit writer thread (api/job_writer.py, worker/jobs/state_writer.py): block for
the first item, then take whatever else has arrived meanwhile, up to a bound. Under load items pile up while
the previous group is written, so groups grow with the load; a writer whose requests arrive spread out (the
worker's, one per job as the engine ends them) can also linger a few milliseconds for company."""

from __future__ import annotations

import queue
import time
from typing import TypeVar

T = TypeVar("T")


def next_group(items: queue.SimpleQueue[T | None], max_items: int, linger_seconds: float = 0.0) -> list[T] | None:
    """The next group, or None once the stop (None) is next. A stop met while draining ends this group and is
    put back, so the following call returns None. With `linger_seconds`, the group waits that long after its
    first item for more to arrive."""
    first = items.get()
    if first is None:
        return None
    group = [first]
    deadline = time.monotonic() + linger_seconds
    while len(group) < max_items:
        try:
            item = items.get_nowait()
        except queue.Empty:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = items.get(timeout=remaining)
            except queue.Empty:
                break
        if item is None:
            items.put(None)
            break
        group.append(item)
    return group
