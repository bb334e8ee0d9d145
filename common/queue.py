"""The Celery app, queues and task names. The API sends tasks by name and never imports worker code."""

from __future__ import annotations

from celery import Celery

from common.settings import Settings

TASK_RUN_JOB = "vlmq.run_job"


def celery_priority(job_priority: int) -> int:
    """Our priority is 0 (lowest) .. 9 (highest); on Redis, Celery's 0 is the highest."""
    return 9 - max(0, min(9, job_priority))


def make_celery(settings: Settings) -> Celery:
    app = Celery("vlmq", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        # SQL holds job state; Celery only delivers, so no result backend.
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        # A message is acked only after the job's result is persisted (DESIGN §2).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.broker_visibility_timeout,
            "queue_order_strategy": "priority",
            "priority_steps": list(range(10)),
        },
        task_default_priority=celery_priority(5),
        task_routes={TASK_RUN_JOB: {"queue": settings.job_queue}},
        worker_hijack_root_logger=False,
        broker_heartbeat=0,
    )
    return app


def send_run_job(app: Celery, settings: Settings, job_id: str, priority: int) -> None:
    app.send_task(
        TASK_RUN_JOB, args=[job_id], queue=settings.job_queue, priority=celery_priority(priority)
    )
