"""Thin Celery tasks; the work is in worker.jobs (the pipeline, the chunk runner, after_job) and
worker.batches (ingest, finalize, sweep).

The tasks are plain functions here, bound to an app by register_tasks: several apps may live in one process
(tests, an embedded run), and each gets task classes of its own whose `task.app` is that app.

Only run_job needs the model: batch tasks use a light context (settings, database, object store) built on
first use, so a `vlmq ingest-worker` process never imports torch and a GPU worker's model is not loaded for
them either.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from celery import Celery, Task
from celery.signals import task_received
from celery.worker.control import control_command

from common.broker.queue import (
    CONTROL_CHECK_LEASES,
    TASK_CANCEL_BATCH,
    TASK_FINALIZE_BATCH,
    TASK_INGEST_BATCH,
    TASK_RUN_JOB,
    TASK_SWEEP_BATCHES,
    app_settings,
    model_sender,
    send_check_leases,
    send_finalize_batch,
    send_ingest_batch,
    send_run_jobs,
)
from common.infra.db import Database, get_database
from common.infra.settings import Settings, get_settings
from common.infra.storage import ObjectStore, make_store
from worker.context import WorkerContext, current_context, get_context
from worker.jobs.after_job import AfterJobDeps, after_job, has_follow_ups
from worker.jobs.pipeline import Outcome
from worker.jobs.prefetch_share import PrefetchShare

log = logging.getLogger(__name__)

BATCH_TASK_RETRIES = 8


@dataclass
class BatchContext:
    settings: Settings
    db: Database
    store: ObjectStore


# Keyed by the app itself, weakly: an id() outlives its app and may be reused by the next one.
_batch_contexts: weakref.WeakKeyDictionary[Celery, BatchContext] = weakref.WeakKeyDictionary()
_batch_lock = threading.Lock()
# Slots of the worker's prefetch taken by messages of several jobs (worker/jobs/prefetch_share.py).
_prefetch = PrefetchShare()


def batch_context(app: Celery) -> BatchContext:
    """Per process and app: the settings the app was made with (embedded runs), else the environment's."""
    with _batch_lock:
        ctx = _batch_contexts.get(app)
        if ctx is None:
            settings = app_settings(app) or get_settings()
            ctx = _batch_contexts[app] = BatchContext(settings, get_database(settings.database_url),
                                                          make_store(settings))
        return ctx


def warm_batch_context(app: Celery) -> None:
    """Make the batch context, and what its tasks import and connect to, before the first batch task arrives
    (common/infra/warm_up.py): the first batch's ingestion and finalization then run as fast as later ones."""
    from common.domain.served_model import served_model
    from common.images.decode import register_image_plugins
    from common.infra.warm_up import warm_up
    from worker.batches import finalize, ingest, sweep  # noqa: F401  (imported by the tasks on first use)

    ctx = batch_context(app)
    warm_up([ctx.db], ctx.store, app)
    register_image_plugins()  # ingestion checks each image
    if ctx.settings.model:
        served_model(ctx.settings.model)  # ingestion counts prompt tokens with the model's tokenizer


def register_tasks(app: Celery) -> None:
    """Bind the tasks below to `app`. Not shared: a shared task is registered on every app made later in the
    process too, where it would run against this one."""
    task_received.connect(_prefetch.on_task_received, weak=False, dispatch_uid="vlmq-prefetch-share")
    app.task(shared=False, name=TASK_RUN_JOB, bind=True, acks_late=True, max_retries=None)(run_job)
    for name, batch_task in ((TASK_INGEST_BATCH, ingest_batch), (TASK_FINALIZE_BATCH, finalize_batch),
                             (TASK_CANCEL_BATCH, cancel_batch)):
        app.task(shared=False, name=name, bind=True, acks_late=True, max_retries=BATCH_TASK_RETRIES)(batch_task)
    app.task(shared=False, name=TASK_SWEEP_BATCHES, bind=True, acks_late=True)(sweep_batches)


def run_job(task: Task, job_ids: str | list[str]) -> str | list[str]:
    """One job (its id), or several sent together (a list of ids: common/broker/queue.run_job_args)."""
    app = task.app
    try:
        # The app's settings: in an embedded run they are the run's, not the environment's.
        ctx = get_context(app_settings(app))
    except Exception as exc:
        # No model to run on (it failed to load): the message waits, the job stays queued.
        log.error("cannot run jobs: the worker's model failed to load: %s", exc)
        raise task.retry(countdown=_model_retry_seconds(app), max_retries=None) from None
    if isinstance(job_ids, list):
        return _run_jobs(task, ctx, [str(job_id) for job_id in job_ids])
    try:
        outcome = ctx.pipeline.run(job_ids)
    except Exception as exc:
        # SQL unreachable before the job was even claimed: the row is still queued, so deliver again later.
        raise task.retry(exc=exc, countdown=ctx.settings.retry_backoff_seconds, max_retries=20) from exc
    if has_follow_ups(outcome):
        after_job(_after_job_deps(app, ctx), job_ids, outcome)
    if outcome.retry:
        raise task.retry(countdown=_backoff(task, ctx.settings.retry_backoff_seconds))
    return outcome.status


def _run_jobs(task: Task, ctx: WorkerContext, job_ids: list[str]) -> list[str]:
    """The rows of one message as a chunk (worker/jobs/chunk_runner.py); those to run again (released, or not
    reached for SQL trouble) go back in one message of their own, as a lone job's message would be retried."""
    task_id, app = task.request.id, task.app

    def ended(job_id: str, result: Outcome | Exception) -> None:
        _prefetch.give_back(task_id, 1)  # a slot of this message's for the worker's next job
        if isinstance(result, Outcome) and has_follow_ups(result):
            after_job(_after_job_deps(app, ctx), job_id, result)

    try:
        results = ctx.chunks.run(job_ids, on_job_done=ended)
    finally:
        _prefetch.give_back(task_id)
    again = [job_id for job_id, result in zip(job_ids, results, strict=True)
             if isinstance(result, Exception) or result.retry]
    errors = [result for result in results if isinstance(result, Exception)]
    if errors:
        raise task.retry(args=[again], exc=errors[0], countdown=ctx.settings.retry_backoff_seconds, max_retries=20)
    if again:
        raise task.retry(args=[again], countdown=_backoff(task, ctx.settings.retry_backoff_seconds))
    return [result.status for result in results if isinstance(result, Outcome)]


def ingest_batch(task: Task, batch_id: str) -> str:
    from worker.batches.ingest import IngestDeps
    from worker.batches.ingest import ingest_batch as ingest

    app = task.app
    ctx = batch_context(app)

    def dispatch(model_settings: Settings, job_ids: list[str], priority: int) -> None:
        send_run_jobs(app, model_settings, job_ids, priority)

    try:
        status = ingest(batch_id, IngestDeps(ctx.settings, ctx.db, ctx.store, dispatch))
    except Exception as exc:
        # SQL, storage or broker trouble: committed chunks stay, the retry resumes after them.
        log.exception("batch %s: ingestion failed (attempt %d)", batch_id, task.request.retries + 1)
        raise task.retry(exc=exc, countdown=_backoff(task, 2.0)) from exc
    # Its jobs may all have ended while later chunks were read; a cancelled ingestion ends here too.
    send_finalize_batch(app, ctx.settings, batch_id)
    return status


def finalize_batch(task: Task, batch_id: str) -> str:
    from worker.batches.finalize import finalize_batch as finalize

    ctx = batch_context(task.app)
    try:
        return finalize(batch_id, ctx.db, ctx.store)
    except Exception as exc:
        log.exception("batch %s: finalization failed", batch_id)
        raise task.retry(exc=exc, countdown=_backoff(task, 2.0)) from exc


def cancel_batch(task: Task, batch_id: str) -> str:
    """Cancel the batch's open jobs, queued and running (the workers running some are told to stop them), then
    end it `cancelled`: it waits for no worker."""
    from worker.batches.finalize import cancel_batch_jobs
    from worker.batches.finalize import finalize_batch as finalize

    app = task.app
    ctx = batch_context(app)
    try:
        cancelled = cancel_batch_jobs(batch_id, ctx.db, tell_workers=lambda: send_check_leases(app))
        log.info("batch %s: %d open jobs cancelled", batch_id, cancelled)
        return finalize(batch_id, ctx.db, ctx.store)
    except Exception as exc:
        raise task.retry(exc=exc, countdown=_backoff(task, 2.0)) from exc


def sweep_batches(task: Task) -> int:
    """Periodic (beat): the maintenance sweep (worker/batches/sweep.py)."""
    from worker.batches.sweep import SweepDeps, sweep

    app = task.app
    ctx = batch_context(app)
    return sweep(SweepDeps(
        ctx.settings, ctx.db, ctx.store, send_jobs=model_sender(app, ctx.settings),
        send_ingest=lambda batch_id: send_ingest_batch(app, ctx.settings, batch_id),
        send_finalize=lambda batch_id: send_finalize_batch(app, ctx.settings, batch_id),
        tell_workers=lambda: send_check_leases(app)))


@control_command(name=CONTROL_CHECK_LEASES)
def check_leases(state: object) -> None:
    """Broadcast (common/broker/queue.send_check_leases) after running jobs were cancelled in SQL: this process's
    worker, if it runs jobs, looks at once which it still holds and stops the others (worker/jobs/leases.py).
    Celery's remote-control commands are the process's, whichever app received it; so is the context."""
    context = current_context()
    if context is not None:
        context.leases.check_soon()


def _after_job_deps(app: Celery, ctx: WorkerContext) -> AfterJobDeps:
    settings = ctx.settings
    return AfterJobDeps(ctx.db, settings.dispatch_window, send_jobs=model_sender(app, settings),
                        send_finalize=lambda batch_id: send_finalize_batch(app, settings, batch_id))


def _model_retry_seconds(app: Celery) -> float:
    """How long a job waits before trying again for a model that failed to load."""
    settings = app_settings(app) or get_settings()
    return max(settings.retry_backoff_seconds, 5.0)


def _backoff(task: Task, base: float) -> float:
    return min(base * (2 ** max(0, task.request.retries)), 300.0)
