"""`python -m tests.stub_worker BROKER_URL PIPELINE CONCURRENCY`: vlmq's own run_job task in a real Celery worker
(threads pool), around a stand-in for the job pipeline, so that message delivery can be tested and measured
without a model, SQL or S3 (tests/worker/jobs/test_job_messages.py, bench/celery_messages.py).

Pipelines, by name; both talk to the broker's Redis, which the parent reads:
- `instant`: each job returns at once and counts itself in `done`.
- `held`: each job appends its id to `ran` and waits until the key `go` exists; `most_running` keeps the most
  jobs that were running at once. A job whose id starts with `again` asks to run again on its first run, one
  starting with `broken` raises on its first run (SQL unreachable before its claim).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import redis

from common.domain.models import JobStatus
from worker.jobs.pipeline import Ending, Outcome

ROOT = Path(__file__).resolve().parents[1]
MODEL = "/models/stub-worker"  # names the queue: senders use it too


class InstantPipeline:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def run(self, job_id: str) -> Outcome:
        self.client.incr("done")
        return Outcome(Ending.SKIPPED)  # no SQL here: nothing for the after-job bookkeeping to do


class HeldPipeline:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.running = 0
        self.lock = threading.Lock()

    def run(self, job_id: str) -> Outcome:
        with self.lock:
            self.running += 1
            self.client.set("most_running", max(self.running, int(self.client.get("most_running") or 0)))
        try:
            self.client.rpush("ran", job_id)
            while not self.client.exists("go"):
                time.sleep(0.01)
            if job_id.startswith("again") and self.client.incr(f"tries:{job_id}") == 1:
                return Outcome(JobStatus.QUEUED, retry=True)
            if job_id.startswith("broken") and self.client.incr(f"tries:{job_id}") == 1:
                raise RuntimeError("SQL is down")
            return Outcome(Ending.SKIPPED)
        finally:
            with self.lock:
                self.running -= 1


PIPELINES = {"instant": InstantPipeline, "held": HeldPipeline}


def start(broker_url: str, pipeline: str, concurrency: int, quiet: bool = False) -> subprocess.Popen[bytes]:
    output = subprocess.DEVNULL if quiet else None
    return subprocess.Popen([sys.executable, "-m", "tests.stub_worker", broker_url, pipeline, str(concurrency)],
                            cwd=ROOT, stdout=output, stderr=output)


def stop(worker: subprocess.Popen[bytes]) -> None:
    """Warm shutdown, or a kill for a worker still there after 30 s (held jobs never end on their own)."""
    worker.terminate()
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(10)


def main() -> None:
    from common.broker.queue import make_celery
    from common.infra.settings import Settings
    from worker import context, tasks
    from worker.jobs.group import JobGroupRunner

    broker_url, name, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3])
    settings = Settings(broker_url=broker_url, model=MODEL, retry_backoff_seconds=0)
    pipeline = PIPELINES[name](redis.Redis.from_url(broker_url))
    groups = JobGroupRunner(pipeline, concurrency + settings.job_ids_per_message)  # type: ignore[arg-type]
    context.set_context(SimpleNamespace(settings=settings, pipeline=pipeline, chunks=groups))  # type: ignore[arg-type]
    app = make_celery(settings)
    tasks.register_tasks(app)
    app.worker_main(["worker", "-Q", settings.job_queue, "-P", "threads", "-c", str(concurrency),
                     "--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "warning"])


if __name__ == "__main__":
    main()
