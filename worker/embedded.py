"""A Celery worker inside the current process, for the embedded configuration (memory:// broker).

`vlmq run` and an embedded `vlmq api` use it: jobs still go through the Celery queue, the state machine and
the pipeline, only the broker and the worker live in this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from celery import Celery
from celery.worker import WorkController
from celery.worker import state as worker_state

from common.queue import send_sweep_batches
from common.settings import Settings
from worker.context import get_context
from worker.tasks import register_tasks


def _sweep_periodically(app: Celery, settings: Settings, stop: threading.Event) -> None:
    """Celery beat's job in embedded mode: the maintenance sweep (reaping leases a previous run of this
    process left behind, expiry, finalize safety net), without beat's schedule file."""
    while not stop.wait(settings.sweep_interval_seconds):
        try:
            send_sweep_batches(app, settings)
        except Exception:
            logging.getLogger(__name__).exception("could not send the maintenance sweep")


class _ThreadWorker(WorkController):
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer: object) -> None:
        self.ready.set()


@contextmanager
def embedded_worker(app: Celery, settings: Settings, ready_timeout: float = 120.0) -> Iterator[WorkController]:
    """Run a threads-pool worker for `settings.job_queue` until the block exits."""
    # memory:// has no host by design; kombu would warn about it on every connection.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    register_tasks(app)
    app.finalize()
    app.set_default()  # tasks' self.app / self.retry must reach this app's broker, not Celery's default
    get_context(settings)  # load the model before consuming, so start-up errors surface here
    worker = _ThreadWorker(
        app=app,
        concurrency=settings.worker_concurrency,
        pool="threads",
        queues=[settings.job_queue],
        hostname=f"embedded-{threading.get_ident()}@localhost",
        loglevel="WARNING",
        ready_callback=None,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )
    thread = threading.Thread(target=worker.start, name="vlmq-embedded-worker", daemon=True)
    thread.start()
    if not worker.ready.wait(ready_timeout):
        raise RuntimeError("embedded worker did not start")
    stop_sweeps = threading.Event()
    threading.Thread(target=_sweep_periodically, args=(app, settings, stop_sweeps), name="vlmq-embedded-beat",
                     daemon=True).start()
    try:
        yield worker
    finally:
        stop_sweeps.set()
        worker_state.should_terminate = 0
        thread.join(30)
        worker_state.should_terminate = None
