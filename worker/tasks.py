"""Thin Celery tasks; the work is in worker.pipeline."""

from __future__ import annotations

from celery import Celery, Task

from common.queue import TASK_RUN_JOB
from worker.context import get_context


def register_tasks(app: Celery) -> None:
    @app.task(name=TASK_RUN_JOB, bind=True, acks_late=True, max_retries=None)
    def run_job(self: Task, job_id: str) -> str:
        ctx = get_context()
        try:
            outcome = ctx.pipeline.run(job_id)
        except Exception as exc:
            # SQL unreachable before the job was even claimed: the row is still queued, so deliver again later.
            raise self.retry(exc=exc, countdown=ctx.settings.retry_backoff_seconds, max_retries=20) from exc
        if outcome.retry:
            backoff = ctx.settings.retry_backoff_seconds * (2 ** max(0, self.request.retries))
            raise self.retry(countdown=min(backoff, 300))
        return outcome.status
