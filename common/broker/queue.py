"""The Celery app, queues and task names. The API sends tasks by name and never imports worker code."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from celery import Celery

from common.broker import fast_send
from common.broker import transport as broker_transport
from common.broker.fast_send import RedisTaskSender
from common.infra.settings import Settings

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from common.broker.dispatch import Send

TASK_RUN_JOB = "vlmq.run_job"
TASK_INGEST_BATCH = "vlmq.ingest_batch"
TASK_FINALIZE_BATCH = "vlmq.finalize_batch"
TASK_CANCEL_BATCH = "vlmq.cancel_batch"
TASK_SWEEP_BATCHES = "vlmq.sweep_batches"
BATCH_TASKS = (TASK_INGEST_BATCH, TASK_FINALIZE_BATCH, TASK_CANCEL_BATCH, TASK_SWEEP_BATCHES)

# The remote-control command (Celery's broadcast to every worker) that has a worker look at once which of its
# jobs it still holds, after some running ones were cancelled (worker/tasks.py handles it).
CONTROL_CHECK_LEASES = "vlmq_check_leases"

# Batch bookkeeping (ingest, finalize, cancel) needs no model, so it has a queue of its own that a light
# `vlmq ingest-worker` can consume; a GPU worker may consume it too (`vlmq worker --ingest`).
INGEST_QUEUE = "ingest"


_SENDER_LOCK = threading.Lock()


def celery_priority(job_priority: int) -> int:
    """Our priority is 0 (lowest) .. 9 (highest); on Redis, Celery's 0 is the highest."""
    return 9 - max(0, min(9, job_priority))


def ingest_queue(settings: Settings) -> str:
    """Where batch tasks (ingest, finalize, cancel, sweep) go. A queue of their own in embedded mode too: the
    memory:// broker ignores priorities, so behind a model queue's backlog a batch's cancel waited for every
    job sent before it (896 of 1,000 ran after the cancel was accepted); the embedded worker consumes both,
    taking from each in turn. The memory broker's queues are shared by the whole process, so there the name
    carries the data folder: another embedded setup in the process must not take this one's batch tasks."""
    if settings.embedded_broker:
        folder = hashlib.sha256(str(settings.data_dir.expanduser().resolve()).encode()).hexdigest()[:12]
        return f"{INGEST_QUEUE}.{folder}"
    return INGEST_QUEUE


def make_celery(settings: Settings) -> Celery:
    broker_transport.install()  # a broker restart must not stop the process (see there)
    app = Celery("vlmq", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        # SQL holds job state; Celery only delivers, so no result backend.
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        # A message is acked only after the job's result is persisted (docs/architecture.md).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.broker_visibility_timeout,
            "queue_order_strategy": "priority",
            "priority_steps": list(range(10)),
            # The in-process broker is polled: kombu's default sleeps a second whenever its queues are empty,
            # so each message sent to an idle embedded worker (a run's first jobs, its finalize, the stop) waited
            # up to that long. A poll of memory:// costs microseconds.
            **({"polling_interval": 0.02} if settings.embedded_broker else {}),
        },
        # memory:// through a subclass that stops at once (common/broker/embedded_transport.py).
        **({"broker_transport": "common.broker.embedded_transport:Transport"} if settings.embedded_broker else {}),
        task_default_priority=celery_priority(5),
        task_routes={
            TASK_RUN_JOB: {"queue": settings.job_queue},
            **{name: {"queue": ingest_queue(settings)} for name in BATCH_TASKS},
        },
        # Safety net for finalize triggers that never came (a job reaped to `dead`, a lost message): for
        # whoever runs Celery beat (`vlmq ingest-worker --beat`).
        beat_schedule={"sweep": {"task": TASK_SWEEP_BATCHES, "schedule": settings.sweep_interval_seconds,
                                 "options": {"queue": ingest_queue(settings), "priority": 0}}},
        worker_hijack_root_logger=False,
        broker_heartbeat=0,
    )
    # Tasks read the settings the app was made with (embedded runs pass overrides that are not in the env).
    app.vlmq_settings = settings
    return app


def app_settings(app: Celery) -> Settings | None:
    return getattr(app, "vlmq_settings", None)


def direct_sender(app: Celery) -> RedisTaskSender | None:
    """The app's direct Redis sender (common/broker/fast_send.py), made once; None when the broker needs Celery."""
    sender: RedisTaskSender | Literal[False] | None = app.__dict__.get("vlmq_direct_sender", False)
    if sender is False:
        with _SENDER_LOCK:
            sender = app.__dict__.get("vlmq_direct_sender", False)
            if sender is False:
                url = app.conf.broker_url or ""
                sender = RedisTaskSender(url) if fast_send.usable(url, app.conf.broker_transport_options) else None
                app.vlmq_direct_sender = sender
    return sender


def send_run_job(app: Celery, settings: Settings, job_id: str, priority: int) -> None:
    send_run_jobs(app, settings, [job_id], priority)


def run_job_args(job_ids: list[str], per_message: int) -> Iterator[list[Any]]:
    """run_job's arguments for `job_ids`, at most `per_message` to a message: a lone job as its id (the form
    every vlmq release reads), several as one list of ids."""
    for start in range(0, len(job_ids), per_message):
        chunk = job_ids[start:start + per_message]
        yield [chunk[0]] if len(chunk) == 1 else [chunk]


def send_run_jobs(app: Celery, settings: Settings, job_ids: Iterable[str], priority: int) -> int:
    """Dispatch many jobs over one broker connection (ingestion sends thousands per chunk), up to
    `job_ids_per_message` to a message; returns the number of jobs sent."""
    ids = list(job_ids)
    messages = run_job_args(ids, settings.job_ids_per_message)
    direct = direct_sender(app)
    if direct is not None:
        direct.send(TASK_RUN_JOB, messages, settings.job_queue, celery_priority(priority))
        return len(ids)
    with app.producer_or_acquire() as producer:
        # kombu >= 5.7 can buffer a producer's publishes into one Redis pipeline (one client and one round
        # trip per 1,000 messages instead of per message, bench/ingest.py); a failed flush raises here, as a
        # failed single send would.
        batch = getattr(producer, "batch", None)
        with batch() if batch is not None else contextlib.nullcontext():
            for args in messages:
                app.send_task(TASK_RUN_JOB, args=args, queue=settings.job_queue,
                              priority=celery_priority(priority), producer=producer)
    return len(ids)


def model_sender(app: Celery, settings: Settings) -> Send:
    """A common.broker.dispatch `Send`: run_job messages to the queue of whichever model the jobs are for."""

    def send(model: str, job_ids: list[str], priority: int) -> int:
        return send_run_jobs(app, settings.model_copy(update={"served_model_name": model}), job_ids, priority)

    return send


def _send_batch_task(app: Celery, settings: Settings, name: str, batch_id: str) -> None:
    # Batch bookkeeping goes ahead of any job message that might share its queue in embedded mode.
    app.send_task(name, args=[batch_id], queue=ingest_queue(settings), priority=0)


def send_ingest_batch(app: Celery, settings: Settings, batch_id: str) -> None:
    _send_batch_task(app, settings, TASK_INGEST_BATCH, batch_id)


def send_finalize_batch(app: Celery, settings: Settings, batch_id: str) -> None:
    _send_batch_task(app, settings, TASK_FINALIZE_BATCH, batch_id)


def send_cancel_batch(app: Celery, settings: Settings, batch_id: str) -> None:
    _send_batch_task(app, settings, TASK_CANCEL_BATCH, batch_id)


def send_sweep_batches(app: Celery, settings: Settings) -> None:
    """What beat sends every sweep_interval_seconds; also handy to run a sweep now."""
    app.send_task(TASK_SWEEP_BATCHES, queue=ingest_queue(settings), priority=0)


def send_check_leases(app: Celery) -> None:
    """Tell every worker that some of the jobs it runs may have been cancelled in SQL: each looks at once which
    it still holds and stops the others. Not waited for, nor answered: a worker that misses it finds out at its
    next heartbeat."""
    app.control.broadcast(CONTROL_CHECK_LEASES)


def tell_workers_to_check_leases(app: Celery, cancelled: str) -> None:
    """send_check_leases after running jobs were cancelled (`cancelled` says which, for the log). A broker that
    cannot take it is logged, not raised: the jobs are cancelled in SQL all the same, and each worker's
    heartbeat finds them."""
    try:
        send_check_leases(app)
    except Exception:
        log.exception("could not tell the workers that %s was cancelled", cancelled)
