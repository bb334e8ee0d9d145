"""The start-up heap, frozen out of the cyclic garbage collector's scans (`VLMQ_GC_FREEZE`).

A serving process tracks hundreds of thousands of objects once it has imported torch, transformers, SQLAlchemy,
Celery and boto3 and loaded a tokenizer, and none of them will ever be garbage. Python's full collection
(generation 2) still walks them all while holding the GIL, and the per-job objects of a busy worker (ORM rows,
messages, requests) trigger one every few seconds: each a pause of the whole process, which bench/compare.py's
service on tiny jobs shows in the worker and the API alike. `gc.freeze()` moves every tracked object to a
permanent generation that collections skip, so they scan only what was made since. vLLM does the same once its
engine is up (vllm/utils/gc_utils.py, freeze_gc_heap).

Called by process entry points once start-up is done (cli/main.py, `vlmq run` once its model is loaded too;
the engine process), never by library code: a frozen object is never freed, which is right for a process's
long-lived state and wrong for the test suite's short-lived stacks.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(collect: bool = True) -> int:
    """Collect what start-up left as garbage (unless `collect` is False: where the process is already at work,
    a full collection is the very pause to avoid), then freeze every object still tracked; returns how many
    are frozen now (this call's and any before)."""
    started = time.perf_counter()
    if collect:
        gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the garbage collector's scans (%.0f ms)", frozen,
             1000 * (time.perf_counter() - started))
    return frozen
