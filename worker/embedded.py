"""A Celery worker inside the current process, for the embedded configuration (memory:// broker).

`vlmq run` and an embedded `vlmq api` use it: jobs still go through the Celery queue, the state machine and
the pipeline, only the broker and the worker live in this process.
"""

from __future__ import annotations

import fcntl
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from celery import Celery
from celery.worker import WorkController
from celery.worker import state as worker_state
from sqlalchemy import update

from common.broker.queue import ingest_queue, send_ingest_batch, send_sweep_batches
from common.domain import batches, jobs
from common.domain.models import Job, JobStatus, utcnow
from common.infra.db import get_database, rowcount
from common.infra.settings import Settings
from worker.context import get_context
from worker.tasks import register_tasks

log = logging.getLogger(__name__)


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


class DataDirBusy(RuntimeError):
    """Another embedded vlmq process holds this data folder."""


@contextmanager
def _sole_owner(data_dir: Path) -> Iterator[None]:
    """Hold `data_dir` for this process alone: the takeover below is only right if no other embedded worker
    runs on the same database."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "embedded.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataDirBusy(f"another vlmq process (vlmq run, or vlmq api in embedded mode) is using {data_dir}; "
                              "wait for it, or give this one another --data-dir / VLMQ_DATA_DIR") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def take_over(settings: Settings) -> tuple[int, int]:
    """Adopt what an earlier embedded process left behind: (jobs sent again, jobs it was running).

    The in-memory broker died with that process, so its queued jobs marked sent have no message anywhere and
    would fill their tenant's dispatch window forever; its running jobs have no worker. With the data folder
    held, no other worker can hold them: the queued ones are marked unsent, the running ones go back to the
    queue (or end `dead` once their attempts are used up, as a lease expiry would do) for dispatch to send."""
    db = get_database(settings.database_url)
    running = 0
    while True:
        with db.session() as session:
            outcome = jobs.reap(session, every_lease=True)
        running += sum(len(ids) for ids in outcome.values())
        if not any(outcome.values()):
            break
    with db.session() as session:
        resent = rowcount(session,
            update(Job).where(Job.status == JobStatus.QUEUED, Job.dispatched_at.is_not(None))
            .values(dispatched_at=None).execution_options(synchronize_session=False))
    return resent, running


def resume_ingestions(app: Celery, settings: Settings) -> int:
    """Send ingest_batch again for every batch still validating: their messages died with the in-memory broker
    of the process before. For `vlmq api`; `vlmq run` ingests the batch it resumes itself."""
    with get_database(settings.database_url).session() as session:
        waiting = batches.validating_since(session, utcnow())
    for batch_id in waiting:
        send_ingest_batch(app, settings, batch_id)
    return len(waiting)


@contextmanager
def embedded_worker(app: Celery, settings: Settings, ready_timeout: float = 120.0, *,
                    model_loaded: Future[None] | None = None) -> Iterator[WorkController]:
    """Run a threads-pool worker for `settings.job_queue` and the batch tasks' queue until the block exits.

    The model is loaded before the worker consumes, so that a bad model stops the start; `model_loaded` (from
    load_in_background) says it is being loaded already, and jobs wait for it."""
    with _sole_owner(settings.data_dir):
        resent, running = take_over(settings)
        if resent or running:
            log.warning("took over from an earlier process: %d queued jobs to send again, %d it was running",
                        resent, running)
        with _embedded_worker(app, settings, ready_timeout, model_loaded) as worker:
            yield worker


def load_in_background(settings: Settings, then: Callable[[], object] | None = None) -> Future[None]:
    """Load the worker's model (its context) on a thread of its own, beside whatever the caller does meanwhile
    (`vlmq run` stores, checks and queues its input), then call `then` there; the future says when that is
    done, or why the model could not be loaded."""
    loaded: Future[None] = Future()

    def load() -> None:
        try:
            get_context(settings)
            if then is not None:
                then()
        except BaseException as exc:
            loaded.set_exception(exc)
        else:
            loaded.set_result(None)

    threading.Thread(target=load, name="vlmq-model-load", daemon=True).start()
    return loaded


@contextmanager
def _embedded_worker(app: Celery, settings: Settings, ready_timeout: float,
                     model_loaded: Future[None] | None) -> Iterator[WorkController]:
    # memory:// has no host by design; kombu would warn about it on every connection.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    register_tasks(app)
    app.finalize()
    app.set_default()  # tasks' self.app / self.retry must reach this app's broker, not Celery's default
    if model_loaded is None:
        get_context(settings)
    worker = _ThreadWorker(
        app=app,
        concurrency=settings.worker_concurrency,
        pool="threads",
        queues=[settings.job_queue, ingest_queue(settings)],
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
