"""The jobs of one run_job message, run side by side, each exactly as a message of its own would run it.

Each job goes through `JobPipeline.run` on a thread of a pool the worker owns (claims and finishes are still
grouped by the pipeline's state writer, across messages), so duplicates, last tries, input errors and
releases behave as they do for one job; the message is acked once all of them have ended.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from common.logs import log_fields
from worker.pipeline import JobPipeline, Outcome


class JobGroupRunner:
    def __init__(self, pipeline: JobPipeline, max_threads: int) -> None:
        self.pipeline = pipeline
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="vlmq-job")

    def run(self, job_ids: list[str], on_job_done: Callable[[str, Outcome | Exception], None] | None = None,
            ) -> list[Outcome | Exception]:
        """Each job's outcome, or the exception its run raised (SQL unreachable before the claim), in order;
        `on_job_done(job_id, outcome)` is called as each ends, on the job's thread."""
        # Each job's thread logs with the message's fields (its Celery task_id) besides its own job_id.
        futures = [self._pool.submit(contextvars.copy_context().run, self._run_one, job_id) for job_id in job_ids]
        if on_job_done is not None:
            for job_id, future in zip(job_ids, futures, strict=True):
                future.add_done_callback(lambda f, job_id=job_id: on_job_done(job_id, _outcome(f)))  # type: ignore[misc]
        wait(futures)
        return [_outcome(future) for future in futures]

    def _run_one(self, job_id: str) -> Outcome:
        with log_fields(job_id=job_id):
            return self.pipeline.run(job_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _outcome(future: Future[Outcome]) -> Outcome | Exception:
    exc = future.exception()
    if exc is None:
        return future.result()
    if isinstance(exc, Exception):
        return exc
    raise exc
