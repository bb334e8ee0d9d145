"""The draining step of a group-commit writer thread (api/job_writer.py, worker/state_writer.py): block for
the first item, then take whatever else has arrived meanwhile, up to a bound. No timer: under load items pile
up while the previous group is written, so groups grow with the load and a lone item goes at once."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def next_group(items: queue.SimpleQueue[T | None], max_items: int) -> list[T] | None:
    """The next group, or None once the stop (None) is next. A stop met while draining ends this group and is
    put back, so the following call returns None."""
    first = items.get()
    if first is None:
        return None
    group = [first]
    while len(group) < max_items:
        try:
            item = items.get_nowait()
        except queue.Empty:
            break
        if item is None:
            items.put(None)
            break
        group.append(item)
    return group
