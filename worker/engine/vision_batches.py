"""The sizes of vision forwards not yet reported, as a list each reporter drains (the engine child's report to
its parent, the worker's metrics scrape). Torch-free.

Appends and drains come from different threads; both are single list operations under the GIL, and a drain
takes only what was there when it began, so sizes appended meanwhile stay for the next one.
"""

from __future__ import annotations

from collections.abc import Iterable

# Sizes kept for a reporter that never comes (no metrics scrape); past this the older half goes.
UNREPORTED_LIMIT = 100_000


def record(sizes: list[int], new: Iterable[int]) -> None:
    sizes.extend(new)
    if len(sizes) > UNREPORTED_LIMIT:
        del sizes[:UNREPORTED_LIMIT // 2]


def take(sizes: list[int]) -> list[int]:
    """Everything recorded so far, removed from `sizes`."""
    count = len(sizes)
    taken = sizes[:count]
    del sizes[:count]
    return taken
