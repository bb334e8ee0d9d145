"""The jobs of one run_job message, each on a thread of the worker's own (worker/jobs/group.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from common.domain.models import JobStatus
from common.infra.logs import FieldsFilter, log_fields
from worker.jobs.group import JobGroupRunner
from worker.jobs.pipeline import Outcome


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(FieldsFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _LoggingPipeline:
    """Stands in for JobPipeline: logs one line per job, from the job's thread, and fails one job outright."""

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def run(self, job_id: str) -> Outcome:
        self.threads.add(threading.current_thread().name)
        logging.getLogger("vlmq.test.group").info("running %s", job_id)
        if job_id == "broken":
            raise ConnectionError("SQL is unreachable")
        return Outcome(JobStatus.SUCCEEDED)


def test_each_job_logs_the_messages_fields_and_its_own_and_ends_on_its_own() -> None:
    handler, logger = _Records(), logging.getLogger("vlmq.test.group")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    pipeline = _LoggingPipeline()
    runner = JobGroupRunner(pipeline, 4)  # type: ignore[arg-type]
    ended: list[tuple[str, Any]] = []
    try:
        with log_fields(task_id="task-1"):  # as the Celery task's prerun sets it (common/infra/logs.py)
            outcomes = runner.run(["a", "broken", "c"], on_job_done=lambda job_id, o: ended.append((job_id, o)))
    finally:
        logger.removeHandler(handler)
        runner.close()
    assert outcomes[0] == outcomes[2] == Outcome(JobStatus.SUCCEEDED)
    assert isinstance(outcomes[1], ConnectionError)
    assert sorted(job_id for job_id, _ in ended) == ["a", "broken", "c"]
    assert all(name.startswith("vlmq-job") for name in pipeline.threads)
    fields = sorted((r.getMessage(), getattr(r, "task_id", None), getattr(r, "job_id", None)) for r in handler.records)
    assert fields == [("running a", "task-1", "a"), ("running broken", "task-1", "broken"),
                      ("running c", "task-1", "c")]
