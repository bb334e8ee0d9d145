"""compose.yaml's services as local processes: the very commands (and healthchecks) the containers run, with
the addresses pointed at this machine's Postgres, Redis and S3 server instead of the compose network.

Docker cannot run here, so this is how the stack is checked end to end: `migrate` runs to completion first
(service_completed_successfully), the bucket is made as minio-init makes it, then api, worker, ingest and
beat start, and each is up when its own healthcheck command passes. The processes of the API image run with
the model stack unimportable (tests/no_torch), as in that image.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import psycopg
import yaml

from tests.conftest import PG_ADMIN_URL, free_port, held_redis_db, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
NO_TORCH = Path(__file__).resolve().parent / "no_torch"
LONG_RUNNING = ("api", "worker", "ingest", "beat")
WORKER_IMAGE_SERVICES = ("worker",)
_VAR = re.compile(r"\$\{([A-Za-z0-9_]+)(?:(:?[-?])([^}]*))?\}")


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}; `$$` is a literal `$`."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            raise KeyError(f"{name}: {arg}")
        return ""

    return _VAR.sub(one, value).replace("$$", "$")


def vlmq_executable() -> str:
    script = Path(sys.executable).parent / "vlmq"  # the console script pyproject.toml installs
    return str(script) if script.exists() else "vlmq"


class LocalStack:
    def __init__(self, base_env: dict[str, str], model: Path, workdir: Path) -> None:
        self.compose = load_compose()
        self.workdir = workdir
        self.api_port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.api_port}"
        # What .env would hold; the addresses below replace the compose network's.
        self.dotenv = {"POSTGRES_PASSWORD": "unused", "MINIO_ROOT_PASSWORD": "unused", "VLMQ_MODEL": str(model)}
        self.local = {**base_env, "VLMQ_MODEL": str(model), "VLMQ_DEVICE": "cpu", "VLMQ_DTYPE": "float32",
                      "VLMQ_METRICS_PORT": str(self.metrics_port), "VLMQ_STATS_INTERVAL_SECONDS": "1",
                      "VLMQ_WORKER_CONCURRENCY": "8", "VLMQ_SWEEP_INTERVAL_SECONDS": "5",
                      "VLMQ_ADMIN_TENANTS": '["ops"]'}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def service(self, name: str) -> dict[str, Any]:
        return self.compose["services"][name]

    def argv(self, args: list[str]) -> list[str]:
        """A compose command line run here: `vlmq` is the installed console script; the API binds loopback on
        a free port instead of 0.0.0.0:8000."""
        out = [interpolate(str(a), self.dotenv) for a in args]
        assert out[0] == "vlmq", out
        out[0] = vlmq_executable()
        replace = {"--host": "127.0.0.1", "--port": str(self.api_port)}
        for i, arg in enumerate(out[:-1]):
            if arg in replace:
                out[i + 1] = replace[arg]
        return [re.sub(r"http://127\.0\.0\.1:8000", self.url, a) for a in out]

    def env(self, name: str) -> dict[str, str]:
        declared = self.service(name).get("environment") or {}
        compose_env = {k: interpolate(str(v), self.dotenv) for k, v in declared.items()}
        env = {**os.environ, **compose_env, **self.local, "VLMQ_DATA_DIR": str(self.workdir / name),
               "OMP_NUM_THREADS": "2"}
        if name not in WORKER_IMAGE_SERVICES:  # the API image has no torch
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NO_TORCH), env.get("PYTHONPATH")]))
        return env

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        migrate = subprocess.run(self.argv(self.service("migrate")["command"]), env=self.env("migrate"),
                                 capture_output=True, timeout=120)
        assert migrate.returncode == 0, migrate.stderr.decode(errors="replace")[-3000:]
        for name in LONG_RUNNING:
            with (self.workdir / f"{name}.log").open("wb") as log:
                self.procs[name] = subprocess.Popen(self.argv(self.service(name)["command"]), env=self.env(name),
                                                    stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        wait_for_port(self.api_port, timeout=60, proc=self.procs["api"])
        for name in LONG_RUNNING:
            self.wait_healthy(name)

    def healthcheck(self, name: str) -> subprocess.CompletedProcess[bytes]:
        test = self.service(name)["healthcheck"]["test"]
        assert test[0] == "CMD", test
        return subprocess.run(self.argv(test[1:]), env=self.env(name), capture_output=True, timeout=60)

    def wait_healthy(self, name: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{self.log(name)[-3000:]}")
            result = self.healthcheck(name)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy: {result.stderr.decode()}\n{self.log(name)[-3000:]}")
            time.sleep(1)

    def api_key(self, tenant: str) -> str:
        """Made as an operator makes one: `vlmq apikey create --tenant T` with the API's settings."""
        out = subprocess.run([vlmq_executable(), "apikey", "create", "--tenant", tenant], env=self.env("api"),
                             capture_output=True, timeout=60, check=True)
        return out.stdout.decode().strip()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for name, proc in self.procs.items():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            tail = self.log(name)[-2000:]
            if "Traceback" in tail:
                print(f"--- {name} log ---\n{tail}")


@contextmanager
def local_stack(s3_env: dict[str, str], model: Path, workdir: Path) -> Iterator[LocalStack]:
    """A stack with its own database, Redis db (not the test session's) and bucket: its status page shows only
    what it did."""
    name = f"vlmq_stack_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    bucket = f"vlmq-stack-{uuid.uuid4().hex[:8]}"
    # minio-init's job: compose sets VLMQ_S3_CREATE_BUCKET=false.
    boto3.client("s3", endpoint_url=s3_env["VLMQ_S3_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    try:
        with held_redis_db() as redis_url:
            base = {**s3_env, "VLMQ_S3_BUCKET": bucket, "VLMQ_BROKER_URL": redis_url,
                    "VLMQ_DATABASE_URL": PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"}
            stack = LocalStack(base, model, workdir)
            try:
                stack.start()
                yield stack
            finally:
                stack.stop()
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus /metrics page as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
