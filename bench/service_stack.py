"""vlmq deployed as compose deploys it, for benchmarks: each service its own process on this machine.

redis-server and a Postgres cluster of their own (tests/fault_stack.py's), the S3 server spoken to directly,
`vlmq api` (uvicorn), `vlmq worker --no-ingest` and `vlmq ingest-worker --beat` as subprocesses, an API key
made as `vlmq apikey create` makes it. Unlike tests/fault_stack.py (the API in the test's own process, S3
behind a Python TCP proxy for fault injection), nothing of the harness sits in the service's path, so the
CPU each part spends per job can be read off /proc and charged to that part alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fault_stack import (  # noqa: E402
    PostgresCluster,
    RedisServer,
    free_port,
    port_open,
    stack_env,
    wait_for,
)

_TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_cpu_seconds(pid: int, tree: dict[int, list[int]] | None = None) -> float:
    """User + system CPU of a process, its live descendants, and the children it has reaped (Postgres
    backends of closed connections)."""
    tree = _children() if tree is None else tree
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    own = (utime + stime + cutime + cstime) / _TICKS
    return own + sum(tree_cpu_seconds(child, tree) for child in tree.get(pid, []))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class ServiceStack:
    def __init__(self, workdir: Path, s3_endpoint: str, model: Path, **settings: Any) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(workdir / "redis")
        self.postgres = PostgresCluster()
        self.s3_endpoint = s3_endpoint
        self.bucket = f"vlmq-bench-{uuid.uuid4().hex[:8]}"
        self.model = model
        self.settings_env = {f"VLMQ_{k.upper()}": str(v) for k, v in settings.items()}
        self.api_port = free_port()
        self.metrics_port = free_port()  # the worker's Prometheus endpoint
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.api_key = ""

    def env(self) -> dict[str, str]:
        return stack_env(self.postgres.url, self.redis.url, self.s3_endpoint, self.bucket, self.model, self.workdir,
                         self.settings_env, VLMQ_LOG_FORMAT="text")

    def _spawn(self, name: str, args: list[str], **env: str) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT,
                                                env={**self.env(), **env}, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def start(self, worker_concurrency: int, worker_threads: int) -> ServiceStack:
        from common.domain.apikeys import create_key
        from common.infra.db import get_database
        from common.infra.migrate import upgrade

        self.redis.start()
        self.postgres.init()
        self.postgres.start()
        boto3.client("s3", endpoint_url=self.s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)
        upgrade(self.postgres.url)
        db = get_database(self.postgres.url)
        with db.session() as session:
            self.api_key = create_key(session, "default").key
        db.dispose()
        self._spawn("api", ["api", "--port", str(self.api_port)], OMP_NUM_THREADS="1")
        self._spawn("maintenance", ["ingest-worker", "--beat"], OMP_NUM_THREADS="1")
        self._spawn("worker", ["worker", "--no-ingest", "--concurrency", str(worker_concurrency)],
                    OMP_NUM_THREADS=str(worker_threads), VLMQ_METRICS_PORT=str(self.metrics_port))
        wait_for(lambda: port_open(self.api_port) or self.processes["api"].poll() is not None, 60, "the API")
        wait_for(lambda: "ready." in self.log("worker") or self.processes["worker"].poll() is not None, 180,
                 "the worker")
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
        return self

    def client(self, **kwargs: Any) -> Any:
        import httpx

        return httpx.Client(base_url=self.api_url, headers={"Authorization": f"Bearer {self.api_key}"},
                            timeout=120, **kwargs)

    def worker_metrics(self) -> dict[str, float]:
        """The worker's Prometheus samples, by name with labels (engine counters lag by up to a second)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def cpu_seconds(self, s3_pid: int) -> dict[str, float]:
        """CPU spent so far by each part of the stack."""
        tree = _children()
        postmaster = int((self.postgres.data / "postmaster.pid").read_text().split()[0])
        parts = {name: proc.pid for name, proc in self.processes.items()}
        parts |= {"postgres": postmaster, "redis": self.redis.proc.pid, "s3": s3_pid}  # type: ignore[union-attr]
        spent = {name: tree_cpu_seconds(pid, tree) for name, pid in parts.items()}
        # The worker's engine process (VLMQ_ENGINE_PROCESS), shown apart: what is left is the job handling.
        engines = [pid for pid in tree.get(self.processes["worker"].pid, []) if b"worker.engine.child" in _cmdline(pid)]
        if engines:
            spent["engine"] = sum(tree_cpu_seconds(pid, tree) for pid in engines)
            spent["worker"] -= spent["engine"]
        return spent

    def close(self) -> None:
        for proc in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.redis.kill()
        self.postgres.remove()
