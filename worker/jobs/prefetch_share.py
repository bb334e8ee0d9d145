"""A run_job message of k jobs takes k of the worker's prefetch slots, not one.

Celery limits what a worker holds by messages: with the threads pool, `worker_concurrency` unacked messages.
Messages of many job ids (common/broker/queue.run_job_args) would let one worker hold `worker_concurrency` times as
many jobs, leaving other workers idle while its jobs wait. So when such a message is received (Celery's
`task_received` signal, in the consumer's thread, before it reads the next message) the consumer's prefetch
count is lowered by k - 1, and raised by one as each of its jobs ends but the last, whose slot Celery frees
with the ack. The prefetch count never goes below one: what could not be taken is not given back.
"""

from __future__ import annotations

import threading
from typing import Any

from common.broker.queue import TASK_RUN_JOB


class PrefetchShare:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[str, tuple[Any, int]] = {}  # task id -> (the consumer's kombu QoS, slots taken)

    def on_task_received(self, sender: Any = None, request: Any = None, **_: object) -> None:
        """celery.signals.task_received: `sender` is the consumer, `request` the task's request."""
        if request is None or request.name != TASK_RUN_JOB or not request.args:
            return
        job_ids = request.args[0]
        qos = getattr(sender, "qos", None)
        if not isinstance(job_ids, list) or len(job_ids) < 2 or qos is None:
            return
        # QoS's own lock (reentrant): the value read and the decrement are one step, so the slots recorded
        # are exactly the ones taken, whatever other threads do to the count meanwhile.
        with qos._mutex:
            before = qos.value
            if not before:
                return  # 0: no limit at all
            taken = before - qos.decrement_eventually(len(job_ids) - 1)
        if taken:
            with self._lock:
                self._taken[request.id] = (qos, taken)

    def give_back(self, task_id: str, slots: int | None = None) -> None:
        """Return `slots` of those the task took (all that remain with None)."""
        with self._lock:
            entry = self._taken.get(task_id)
            if entry is None:
                return
            qos, taken = entry
            n = taken if slots is None else min(slots, taken)
            if n == taken:
                del self._taken[task_id]
            else:
                self._taken[task_id] = (qos, taken - n)
        qos.increment_eventually(n)

    def taken(self, task_id: str) -> int:
        with self._lock:
            entry = self._taken.get(task_id)
            return 0 if entry is None else entry[1]
