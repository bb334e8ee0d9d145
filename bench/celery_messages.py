"""What a run_job message costs a worker, by how many jobs it carries (`VLMQ_JOB_IDS_PER_MESSAGE`).

A real Celery worker process (vlmq's app and its run_job task, threads pool, concurrency 64:
tests/stub_worker.py) consumes jobs whose pipeline does nothing (each job returns at once), so what is measured
is the delivery: Celery's receipt, task call and ack, and vlmq's grouping (worker/jobs/group.py,
worker/jobs/prefetch_share.py). The messages are written by common/broker/queue.send_run_jobs, as the API and ingestion
write them. Rounds alternate the group sizes; medians of the worker's CPU per job and the wall time to drain
them.

    .venv/bin/python bench/celery_messages.py [--jobs 3000] [--rounds 5] [--sizes 1,4,16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.broker.queue import make_celery, send_run_jobs  # noqa: E402
from common.infra.settings import Settings  # noqa: E402
from tests import stub_worker  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(broker_url: str, per_message: int, jobs: int) -> tuple[float, float]:
    """(worker CPU ms per job, seconds to drain) for `jobs` jobs sent `per_message` to a message."""
    client = redis.Redis.from_url(broker_url)
    client.flushdb()
    worker = stub_worker.start(broker_url, "instant", 64, quiet=True)
    try:
        settings = Settings(broker_url=broker_url, model=stub_worker.MODEL, job_ids_per_message=per_message)
        app = make_celery(settings)
        send_run_jobs(app, settings, ["warm-up"], 5)
        deadline = time.monotonic() + 60
        while int(client.get("done") or 0) < 1:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bench worker did not start")
            time.sleep(0.05)
        time.sleep(0.5)
        client.set("done", 0)
        cpu, start = _cpu_seconds(worker.pid), time.perf_counter()
        send_run_jobs(app, settings, [f"job{i}" for i in range(jobs)], 5)
        while int(client.get("done") or 0) < jobs:
            if worker.poll() is not None or time.monotonic() > deadline + 300:
                raise RuntimeError("the bench worker stopped or stalled")
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        return 1000 * (_cpu_seconds(worker.pid) - cpu) / jobs, seconds
    finally:
        stub_worker.stop(worker)
        client.flushdb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1,4,16", help="jobs per message to compare")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.jobs} jobs a round, "
          f"{args.rounds} rounds alternating")
    results: dict[int, list[tuple[float, float]]] = {size: [] for size in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            results[size].append(one_round(args.broker, size, args.jobs))
    base_cpu = statistics.median(r[0] for r in results[sizes[0]])
    base_wall = statistics.median(r[1] for r in results[sizes[0]])
    print(f"{'jobs/message':>12} {'CPU ms/job':>11} {'vs ' + str(sizes[0]):>8} {'drain s':>8} {'jobs/s':>8}")
    for size in sizes:
        cpu = statistics.median(r[0] for r in results[size])
        wall = statistics.median(r[1] for r in results[size])
        print(f"{size:>12} {cpu:>11.3f} {base_cpu / cpu:>7.2f}x {wall:>8.2f} {args.jobs / wall:>8.0f}"
              f"   (CPU {', '.join(f'{r[0]:.3f}' for r in results[size])})")
    print(f"drain time vs {sizes[0]}: " + ", ".join(
        f"{size}: {base_wall / statistics.median(r[1] for r in results[size]):.2f}x" for size in sizes))


if __name__ == "__main__":
    main()
