"""Keep freed memory in the process instead of handing it back to the OS after every step.

glibc serves large blocks (the per-step K/V gathers, SDPA workspaces: tens of MB) with mmap and unmaps them on
free, so every step page-faults them in again, which costs a gather far more than its copy from reused memory.
Raising the mmap and trim thresholds makes glibc reuse the heap. Process-wide, so it is called
once by whoever owns the process's model (the engine; benchmarks before their baselines too, so all compare
alike). A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_tuned = False


def keep_freed_memory() -> bool:
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    if not ok:
        log.info("mallopt refused the thresholds; keeping the default allocator behaviour")
    _tuned = ok
    return ok
