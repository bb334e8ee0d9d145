"""Chaos: jobs through the real stack (half of them the rows of one Batch API file, half single jobs) while
workers are SIGKILLed at random, Redis restarts empty once and Postgres crash-restarts once. Prints lost,
stuck and duplicated counts (all must be 0) and the wall-time overhead against an undisturbed run of the same
number of jobs on the same stack, measured side by side.

    .venv/bin/python bench/chaos.py --jobs 1000 --kills 6          # the full run
    .venv/bin/python bench/chaos.py --jobs 200 --kills 2 --check   # CI's (tests/test_chaos.py): exit 1 if unclean

Parts: its own redis-server and Postgres cluster (initdb) on spare loopback ports, moto's S3 server, the API
in this process, `vlmq worker` processes with a tiny random LLaVA, and the maintenance process (`vlmq
ingest-worker --beat`: reaper, republisher). Leases and the sweep are short, as in tests/test_durability.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fault_stack import FaultStack, Process, free_port, port_open, wait_for  # noqa: E402


@dataclass
class RunResult:
    name: str
    jobs: int
    seconds: float
    statuses: dict[str, int]
    lost: int
    stuck: int
    duplicated: int
    missing_result: int
    over_attempts: int
    attempts: dict[int, int]
    events: list[str] = field(default_factory=list)
    maintenance_restarts: int = 0
    worker_exits: int = 0  # workers that exited by themselves (not the chaos's SIGKILL)

    @property
    def clean(self) -> bool:
        """Every job succeeded exactly once: nothing lost, stuck, duplicated, or worn out by the faults."""
        return (self.statuses == {"succeeded": self.jobs} and not self.lost and not self.duplicated
                and not self.missing_result and not self.over_attempts)


class Supervisor:
    """Keeps `n` workers running, as a container restart policy would, and does the chaos it is told to."""

    def __init__(self, stack: FaultStack, n: int) -> None:
        self.stack, self.n = stack, n
        self.workers: list[Process] = []
        self.events: list[str] = []
        self.exits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Supervisor:
        for _ in range(self.n):
            self.workers.append(self.stack.worker(concurrency=8))
        for worker in self.workers:
            self.stack.wait_worker_ready(worker)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            for i, worker in enumerate(self.workers):
                if not worker.alive():
                    if worker.proc.returncode != -signal.SIGKILL:
                        self.exits += 1
                        self.events.append(f"{time.monotonic():.1f} worker pid {worker.proc.pid} exited by itself "
                                           f"with status {worker.proc.returncode}")
                    self.workers[i] = self.stack.worker(concurrency=8)

    def kill_one(self, rng: random.Random) -> None:
        worker = rng.choice([w for w in self.workers if w.alive()] or self.workers)
        worker.signal(signal.SIGKILL)
        self.events.append(f"{time.monotonic():.1f} SIGKILL worker pid {worker.proc.pid}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for worker in self.workers:
            worker.signal(signal.SIGKILL)
            worker.proc.wait(20)


def one_run(stack: FaultStack, name: str, n_jobs: int, n_workers: int, kills: int, restarts: bool, seed: int,
            timeout: float, batch_share: float = 0.0, max_tokens: int = 16) -> RunResult:
    rng = random.Random(seed)
    restarts_before = stack.maintenance_restarts
    supervisor = Supervisor(stack, n_workers).start()
    try:
        started = time.monotonic()
        prompts = [f"{name} {i}: say something about item {i}" for i in range(n_jobs)]
        # Batch rows travel many to a message and run as chunks, so kills land mid-chunk; single jobs one each.
        n_rows = round(n_jobs * batch_share)
        job_ids = stack.submit_batch(prompts[:n_rows], max_tokens=max_tokens)[1] if n_rows else []
        job_ids += stack.submit(prompts[n_rows:], max_tokens=max_tokens)
        # Faults fire as the run passes fractions of its jobs: kills at random points, Redis at a third,
        # Postgres at two thirds.
        plan = sorted([(rng.uniform(0.15, 0.9), "kill") for _ in range(kills)]
                      + ([(0.33, "redis"), (0.66, "postgres")] if restarts else []))
        deadline = started + timeout
        while True:
            done = stack.count(job_ids, "succeeded", "failed", "dead", "cancelled")
            if done == n_jobs or time.monotonic() > deadline:
                break
            while plan and done >= plan[0][0] * n_jobs:
                _, what = plan.pop(0)
                if what == "kill":
                    supervisor.kill_one(rng)
                elif what == "redis":
                    stack.redis.restart(down_seconds=1)
                    supervisor.events.append(f"{time.monotonic():.1f} redis restarted (empty)")
                else:
                    stack.postgres.restart(down_seconds=2)
                    supervisor.events.append(f"{time.monotonic():.1f} postgres crash-restarted")
            time.sleep(0.2)
        seconds = time.monotonic() - started
    finally:
        supervisor.close()
    report = stack.report(job_ids)
    return RunResult(name, n_jobs, seconds, dict(report.statuses), len(report.lost), len(report.stuck),
                     len(report.duplicated), len(report.missing_result), len(report.over_attempts),
                     dict(sorted(report.attempts.items())), supervisor.events,
                     stack.maintenance_restarts - restarts_before, supervisor.exits)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=6, help="random worker SIGKILLs during the chaos run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every job ended once, cleanly, and no process exited by itself")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="per job: enough that the run outlasts its faults (each fires at a share of jobs done)")
    parser.add_argument("--batch-share", type=float, default=0.5,
                        help="the share of the jobs sent as the rows of one Batch API file; the rest by POST /v1/jobs")
    args = parser.parse_args(argv)

    from worker.inference.tiny_model import build_tiny_llava

    work = Path(tempfile.mkdtemp(prefix="vlmq-chaos-"))
    s3_port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack = None
    try:
        wait_for(lambda: port_open(s3_port), 30, "the S3 server")
        model = build_tiny_llava(work / "tiny-llava", seed=0)
        stack = FaultStack(work / "stack", f"http://127.0.0.1:{s3_port}", model, lease_seconds=4,
                           heartbeat_seconds=1, max_attempts=5, retry_backoff_seconds=0.5, sweep_interval_seconds=1,
                           republish_grace_seconds=2, device="cpu", dtype="float32", max_num_seqs=16).start()
        results = [
            one_run(stack, "undisturbed", args.jobs, args.workers, 0, False, args.seed, args.timeout,
                    args.batch_share, args.max_tokens),
            one_run(stack, "chaos", args.jobs, args.workers, args.kills, True, args.seed, args.timeout,
                    args.batch_share, args.max_tokens),
        ]
    finally:
        if stack is not None:
            stack.close()
        moto.terminate()
        moto.wait(10)

    print(f"cpu: {cpu_name()}, {args.workers} workers, {args.jobs} jobs per run")
    print(f"{'run':<12} {'seconds':>8} {'lost':>5} {'stuck':>6} {'dup':>4} {'no-result':>9} {'>max':>5}  statuses"
          "  attempts")
    for r in results:
        print(f"{r.name:<12} {r.seconds:>8.1f} {r.lost:>5} {r.stuck:>6} {r.duplicated:>4} {r.missing_result:>9} "
              f"{r.over_attempts:>5}  {r.statuses}  {r.attempts}")
    base, chaos = results
    print(f"processes that exited by themselves (a restart policy would restart them): "
          f"maintenance {chaos.maintenance_restarts}x, workers {chaos.worker_exits}x")
    print(f"chaos events: {len(chaos.events)}")
    for event in chaos.events:
        print(f"  {event}")
    print(f"time overhead of chaos: {chaos.seconds / base.seconds:.2f}x the undisturbed run")
    self_exits = sum(r.maintenance_restarts + r.worker_exits for r in results)
    summary: dict[str, Any] = {"runs": [asdict(r) for r in results], "overhead": chaos.seconds / base.seconds,
                               "clean": all(r.clean for r in results), "self_exits": self_exits}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(f"lost={chaos.lost} duplicated={chaos.duplicated} stuck={chaos.stuck} clean={summary['clean']}")
    if args.check and (not summary["clean"] or self_exits):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
