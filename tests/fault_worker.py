"""`python -m tests.fault_worker ARGS`: `vlmq ARGS` with a fault injected, for tests/test_durability.py.

The real CLI and worker, plus the patches VLMQ_TEST_FAULTS names (comma-separated):

- `crash_after_persist:PATH`: the first process to have written a result object, and not yet finished its
  row, SIGKILLs itself there (PATH marks that it happened, so the job's next attempt goes through).
- `poison:WORD`: a job whose prompt holds WORD SIGKILLs the process that runs it, on every attempt.
- `unrecoverable`: the Celery worker's consumer fails to start with the AttributeError kombu once raised on
  a broker restart, which Celery logs as an "Unrecoverable error" before it stops the worker.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_consumer_start() -> None:
    from celery import bootsteps

    import common.broker.queue

    class BrokenConsumerStep(bootsteps.StartStopStep):
        def start(self, parent: Any) -> None:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")

    make_celery = common.broker.queue.make_celery

    def make_broken_celery(*args: Any, _make: Any = make_celery, **kwargs: Any) -> Any:
        app = _make(*args, **kwargs)
        app.steps["consumer"].add(BrokenConsumerStep)
        return app

    common.broker.queue.make_celery = make_broken_celery


def install(faults: str) -> None:
    for fault in filter(None, faults.split(",")):
        kind, _, arg = fault.partition(":")
        if kind == "unrecoverable":
            _fail_consumer_start()
        elif kind == "crash_after_persist":
            from worker.jobs.pipeline import JobPipeline

            marker = Path(arg)
            finish = JobPipeline._finish

            def finish_or_crash(self: JobPipeline, job_id: str, result: Any, _finish: Any = finish,
                                marker: Path = marker) -> bool:
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return _finish(self, job_id, result)
                os.write(fd, job_id.encode())
                os.close(fd)
                _die()
                raise AssertionError("unreachable")

            JobPipeline._finish = finish_or_crash  # type: ignore[method-assign]
        elif kind == "poison":
            import worker.jobs.pipeline

            build = worker.jobs.pipeline.generation_request

            def build_or_die(*args: Any, _build: Any = build, _word: str = arg, **kwargs: Any) -> Any:
                request = _build(*args, **kwargs)
                if any(_word in part.get("text", "") for m in request.messages for part in m["content"]):
                    _die()
                return request

            worker.jobs.pipeline.generation_request = build_or_die
        else:
            raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    install(os.environ.get("VLMQ_TEST_FAULTS", ""))
    from cli.main import main

    sys.argv = ["vlmq", *sys.argv[1:]]
    main()
