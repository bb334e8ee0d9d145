"""The worker's pool of job threads: a row of a run_job message that cannot take the chunk's fast path
(worker/jobs/chunk_runner.py) runs on one of them, exactly as a message of its own would run it.

Claims and finishes are still grouped by the pipeline's state writer, across threads and messages, so
duplicates, last tries, input errors and releases behave as they do for one job.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from common.domain.claimed_job import ClaimedJob
from common.infra.logs import log_fields
from worker.jobs.pipeline import JobPipeline, Outcome

OnJobDone = Callable[[str, Outcome | Exception], None]
T = TypeVar("T")


class JobGroupRunner:
    def __init__(self, pipeline: JobPipeline, max_threads: int) -> None:
        self.pipeline = pipeline
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="vlmq-job")

    def run(self, job_ids: list[str], on_job_done: OnJobDone | None = None) -> list[Outcome | Exception]:
        """Each job's outcome, or the exception its run raised (SQL unreachable before the claim), in order;
        `on_job_done(job_id, outcome)` is called as each ends, on the job's thread."""
        futures = [self.submit(self.pipeline.run, job_id, on_job_done) for job_id in job_ids]
        wait(futures)
        return [self.outcome(future) for future in futures]

    def submit(self, run: Callable[[T], Outcome], job: T, on_job_done: OnJobDone | None = None) -> Future[Outcome]:
        """`run(job)` on a job thread, `job` an id or a ClaimedJob; its outcome is handed to `on_job_done`."""
        job_id = job.id if isinstance(job, ClaimedJob) else str(job)
        # Each job's thread logs with the message's fields (its Celery task_id) besides its own job_id.
        future = self._pool.submit(contextvars.copy_context().run, self._run_one, run, job, job_id)
        if on_job_done is not None:
            future.add_done_callback(lambda f: on_job_done(job_id, self.outcome(f)))
        return future

    def submit_call(self, call: Callable[[], None]) -> None:
        self._pool.submit(contextvars.copy_context().run, call)

    @staticmethod
    def _run_one(run: Callable[[T], Outcome], job: T, job_id: str) -> Outcome:
        with log_fields(job_id=job_id):
            return run(job)

    @staticmethod
    def outcome(future: Future[Outcome]) -> Outcome | Exception:
        """The outcome, or the exception the run raised; waits for it."""
        exc = future.exception()
        if exc is None:
            return future.result()
        if isinstance(exc, Exception):
            return exc
        raise exc

    def close(self) -> None:
        self._pool.shutdown(wait=False)
