"""A vlmq stack whose parts can be broken: its own redis-server and Postgres cluster on spare loopback ports,
the S3 server behind a TCP proxy that can refuse connections, workers as real processes.

Used by tests/test_durability.py and bench/chaos.py. Nothing here touches the machine's shared Postgres or
Redis: the fault tests kill and restart only what they started.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from sqlalchemy import select

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "dead", "cancelled")


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range. A port from bind(0) lies inside that range, so an
    outgoing connection (a client of Postgres, Redis, S3) could be given it before the server meant to listen
    there binds it: a worker's metrics port once was ("Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # free on every interface, as a server listening on any of them needs
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found between 10000 and {low}")


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class RedisServer:
    """redis-server without persistence, as production would lose it: a restart comes back empty. With
    `appendonly` (settable between restarts), every write is in its AOF before Redis answers it, so a restart,
    even after SIGKILL, comes back with everything it had."""

    def __init__(self, workdir: Path, appendonly: bool = False) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: port_open(self.port), 20, f"redis on {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart(self, down_seconds: float = 0.0) -> None:
        self.kill()
        time.sleep(down_seconds)
        self.start()


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise RuntimeError(f"{name} not found (Debian's postgresql package installs it)")
    return found


class PostgresCluster:
    """A throwaway cluster (initdb in a temp folder). Run as the postgres user when we are root, since
    Postgres refuses to run as root."""

    def __init__(self) -> None:
        # A folder of its own under /tmp: the postgres user cannot enter pytest's (mode 700, root's).
        self.workdir = Path(tempfile.mkdtemp(prefix="vlmq-pg-"))
        self.data = self.workdir / "data"
        self.port = free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=timeout)

    def init(self) -> None:
        if self.as_user:
            shutil.chown(self.workdir, "postgres", "postgres")
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8", timeout=120)

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.workdir} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.workdir / "log"), "-o", options, "-w",
                  "start")

    def stop(self, mode: str = "immediate") -> None:
        """`immediate`: as a crash (no shutdown checkpoint; recovery at the next start)."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class TcpProxy:
    """Forwards 127.0.0.1:port to a target; `down()` closes every connection and refuses new ones, as an S3
    endpoint that went away would, and `up()` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """To its whole process group: `ingest-worker --beat` runs beat in a child that would outlive it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group may be gone already
            os.killpg(self.proc.pid, sig)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class Report:
    """What became of a set of accepted jobs."""

    statuses: Counter[str]
    lost: list[str]  # accepted (202), but no row
    stuck: list[str]  # a row that is not in a terminal state
    duplicated: list[str]  # more than one result object, or a result object for a job that did not succeed
    missing_result: list[str]  # succeeded without its result object, or with one that disagrees with the row
    over_attempts: list[str]
    attempts: Counter[int] = field(default_factory=Counter)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.stuck or self.duplicated or self.missing_result or self.over_attempts)


def stack_env(database_url: str, broker_url: str, s3_endpoint: str, bucket: str, model: Path, workdir: Path,
              settings_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The environment of a stack's `vlmq` processes (this file's and bench/service_stack.py's): its services,
    auth on, offline; `extra` next, and `settings_env` (VLMQ_* settings) over all."""
    return {
        **os.environ,
        "VLMQ_DATABASE_URL": database_url,
        "VLMQ_BROKER_URL": broker_url,
        "VLMQ_STORAGE_BACKEND": "s3",
        "VLMQ_S3_ENDPOINT_URL": s3_endpoint,
        "VLMQ_S3_BUCKET": bucket,
        "VLMQ_S3_ACCESS_KEY_ID": "testing",
        "VLMQ_S3_SECRET_ACCESS_KEY": "testing",
        "VLMQ_MODEL": str(model),
        "VLMQ_DATA_DIR": str(workdir / "data"),
        "VLMQ_AUTH": "on",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
        **settings_env,
    }


class FaultStack:
    """API in this process (uvicorn thread), workers and the maintenance process as subprocesses."""

    def __init__(self, workdir: Path, s3_endpoint: str, model: Path, **settings: Any) -> None:
        self.workdir = workdir
        self.redis = RedisServer(workdir / "redis")
        self.postgres = PostgresCluster()
        self.s3_target = int(s3_endpoint.rsplit(":", 1)[1])
        self.s3 = TcpProxy(self.s3_target)
        self.bucket = f"vlmq-faults-{uuid.uuid4().hex[:8]}"
        self.model = model
        self.settings_env = {f"VLMQ_{k.upper()}": str(v) for k, v in settings.items()}
        self.processes: list[Process] = []
        self.maintenance_restarts = 0
        self.api: Any = None
        self._n = 0

    # -- parts -------------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return stack_env(self.postgres.url, self.redis.url, f"http://127.0.0.1:{self.s3.port}", self.bucket,
                         self.model, self.workdir, self.settings_env, OMP_NUM_THREADS="1")

    def settings(self) -> Any:
        from common.infra.settings import Settings

        env = self.env()
        values: dict[str, Any] = {k.removeprefix("VLMQ_").lower(): v for k, v in env.items() if k.startswith("VLMQ_")}
        return Settings(**values)

    def start(self) -> FaultStack:
        from common.infra.migrate import upgrade
        from tests.conftest import ApiServer

        self.redis.start()
        self.postgres.init()
        self.postgres.start()
        self.s3.up()
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.s3_target}", region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)
        settings = self.settings()
        upgrade(settings.database_url)
        self.api = ApiServer(settings).__enter__()
        self.maintenance = self.spawn("maintenance", ["ingest-worker", "--beat"])
        self._closing = threading.Event()
        self._keeper = threading.Thread(target=self._keep_maintenance, daemon=True)
        self._keeper.start()
        return self

    def _keep_maintenance(self) -> None:
        """Restart the maintenance process when it exits, as compose's `restart: unless-stopped` does: the
        reaper and republisher must come back. `maintenance_restarts` counts it: a broker restart alone must
        not need it (tests/test_durability.py)."""
        while not self._closing.wait(0.5):
            if not self.maintenance.alive():
                self.maintenance_restarts += 1
                self.maintenance = self.spawn("maintenance", ["ingest-worker", "--beat"])

    def close(self) -> None:
        if hasattr(self, "_closing"):
            self._closing.set()
            self._keeper.join(5)  # no restart after this point
        for p in self.processes:
            p.signal(signal.SIGKILL)
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(10)
        if self.api is not None:
            self.api.__exit__(None, None, None)
            self.api.app.state.vlmq.db.dispose()
        self.s3.down()
        self.redis.kill()
        self.postgres.remove()

    def spawn(self, name: str, args: list[str], faults: str = "", **env: str) -> Process:
        """A `vlmq` command as its own process; with `faults`, through tests/fault_worker.py (see there)."""
        self._n += 1
        log = self.workdir / f"{name}-{self._n}.log"
        entry = [sys.executable, "-m", "tests.fault_worker" if faults else "cli.main"]
        with log.open("wb") as out:
            proc = subprocess.Popen([*entry, *args, "--loglevel", "INFO"], cwd=ROOT,
                                    env={**self.env(), "VLMQ_TEST_FAULTS": faults, **env},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        process = Process(name, proc, log)
        self.processes.append(process)
        return process

    def worker(self, concurrency: int = 4, faults: str = "", **env: str) -> Process:
        return self.spawn("worker", ["worker", "--no-ingest", "--concurrency", str(concurrency)], faults, **env)

    def wait_worker_ready(self, worker: Process, timeout: float = 120) -> None:
        """Ready once Celery says so in the log (the model loads before it takes any message)."""
        wait_for(lambda: "ready." in worker.tail(200_000) or not worker.alive(), timeout, "worker ready")
        if not worker.alive():
            raise RuntimeError(f"worker exited with {worker.proc.returncode}:\n{worker.tail()}")

    # -- jobs --------------------------------------------------------------------------------------------
    def submit(self, prompts: Iterable[str], max_tokens: int = 24) -> list[str]:
        ids = []
        with self.api.client() as client:
            for prompt in prompts:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
                response = client.post("/v1/jobs", json=body)
                assert response.status_code == 202, response.text
                ids.append(response.json()["id"])
        return ids

    def submit_batch(self, prompts: Iterable[str], max_tokens: int = 24) -> tuple[str, list[str]]:
        """The prompts as the rows of one OpenAI Batch API file: (the batch's id, its jobs' ids, in line order)
        once ingestion has written them all."""
        from common.domain.models import Batch, Job

        lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}})
                 for i, prompt in enumerate(prompts)]
        with self.api.client() as client:
            upload = client.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("rows.jsonl", ("\n".join(lines) + "\n").encode())})
            assert upload.status_code == 200, upload.text
            created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                       "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            assert created.status_code == 200, created.text
        batch_id = created.json()["id"]

        def ingested() -> bool:
            with self._db().session() as session:
                batch = session.get(Batch, batch_id)
                return batch is not None and batch.status != "validating"

        wait_for(ingested, 120, "the batch's ingestion")
        with self._db().session() as session:
            job_ids = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id).order_by(Job.line)))
        assert len(job_ids) == len(lines)
        return batch_id, job_ids

    def batch_status(self, batch_id: str) -> str | None:
        from common.domain.models import Batch

        with self._db().session() as session:
            return session.scalar(select(Batch.status).where(Batch.id == batch_id))

    def _db(self) -> Any:
        from common.infra.db import get_database

        return get_database(self.settings().database_url)

    def statuses(self, job_ids: list[str]) -> Counter[str]:
        from common.domain.models import Job

        with self._db().session() as session:
            rows = session.execute(select(Job.status).where(Job.id.in_(job_ids))).scalars()
            return Counter(rows)

    def count(self, job_ids: list[str], *statuses: str) -> int:
        try:
            counts = self.statuses(job_ids)
        except Exception:  # Postgres being restarted
            return -1
        return sum(counts[s] for s in statuses)

    def wait_terminal(self, job_ids: list[str], timeout: float) -> None:
        wait_for(lambda: self.count(job_ids, *TERMINAL) == len(job_ids), timeout,
                 f"{len(job_ids)} jobs to end", interval=0.25)

    def report(self, job_ids: list[str]) -> Report:
        """Every accepted job in exactly one terminal state with exactly one result: a single job's object under
        its key, agreeing with the row; a batch row's in the row alone, with no object. Attempts within the
        maximum."""
        import json

        from common.domain.models import Job
        from common.infra.storage import result_key

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.s3_target}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        objects: Counter[str] = Counter()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for obj in page.get("Contents", []):
                if "/results/" in obj["Key"] or obj["Key"].startswith("results/"):
                    objects[obj["Key"]] += 1
        with self._db().session() as session:
            rows = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(job_ids)))}
        lost: list[str] = []
        stuck: list[str] = []
        duplicated, missing, over = [], [], []
        statuses: Counter[str] = Counter()
        attempts: Counter[int] = Counter()
        for job_id in job_ids:
            job = rows.get(job_id)
            if job is None or job.status not in TERMINAL:
                (lost if job is None else stuck).append(job_id)
                continue
            statuses[job.status] += 1
            attempts[job.attempts] += 1
            if job.attempts > job.max_attempts:
                over.append(job_id)
            key = result_key(job_id, job.tenant)
            others = [k for k in objects if job_id in k and k != key]
            if others or objects[key] > 1 or (objects[key] and (job.status != "succeeded" or job.batch_id)):
                duplicated.append(job_id)
            if job.status == "succeeded" and job.batch_id is not None:
                if job.result_key is not None or job.result_text is None:
                    missing.append(job_id)
            elif job.status == "succeeded":
                if job.result_key != key or not objects[key]:
                    missing.append(job_id)
                    continue
                body = json.loads(s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
                if body["choices"][0]["message"]["content"] != job.result_text:
                    missing.append(job_id)
        return Report(statuses, lost, stuck, duplicated, missing, over, attempts)
