"""Real parts for the tests: the machine's Postgres and Redis, moto's S3 server over HTTP, tiny checkpoints.

Nothing here mocks our own services. Each test session gets its own Postgres database, its own Redis db
number and its own S3 server process, so runs never see each other's state.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from tests.fault_stack import free_port
from tests.s3_server import S3Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PG_ADMIN_URL = os.environ.get("VLMQ_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("VLMQ_TEST_REDIS", "redis://127.0.0.1:6379")


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session."""
    name = f"vlmq_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url.replace("postgresql://", "postgresql+psycopg://", 1)
    from common.infra.db import _databases

    for db in list(_databases.values()):
        db.dispose()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def held_redis_db() -> Iterator[str]:
    """The URL of a Redis db number of its own, flushed before and after. Test runs side by side on one Redis
    (a developer's and a CI check) each hold their db numbers by keys in db 0, so none flushes another's
    queues."""
    client = redis.Redis.from_url(f"{REDIS_BASE}/0")
    claim = uuid.uuid4().hex
    try:
        for db_index in random.sample(range(1, 16), 15):
            if client.set(f"vlmq-test-db:{db_index}", claim, nx=True, ex=4 * 3600):
                break
        else:
            raise RuntimeError("Redis dbs 1-15 are all held by other test runs (keys vlmq-test-db:* in db 0)")
        url = f"{REDIS_BASE}/{db_index}"
        redis.Redis.from_url(url).flushdb()
        try:
            yield url
        finally:
            redis.Redis.from_url(url).flushdb()
            if client.get(f"vlmq-test-db:{db_index}") == claim.encode():
                client.delete(f"vlmq-test-db:{db_index}")
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with held_redis_db() as url:
        yield url


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server in its own process, spoken to over HTTP."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def rclone_s3_endpoint() -> Iterator[str]:
    """A second, independent S3 implementation (`rclone serve s3`, Go, over a folder), so the object store is
    not only ever checked against moto."""
    server = S3Server("rclone")
    try:
        yield server.endpoint
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_env(s3_endpoint: str) -> dict[str, str]:
    """VLMQ_* settings for the S3 backend against the test server (moto accepts any credentials)."""
    return {
        "VLMQ_STORAGE_BACKEND": "s3",
        "VLMQ_S3_ENDPOINT_URL": s3_endpoint,
        "VLMQ_S3_BUCKET": f"vlmq-test-{uuid.uuid4().hex[:8]}",
        "VLMQ_S3_ACCESS_KEY_ID": "testing",
        "VLMQ_S3_SECRET_ACCESS_KEY": "testing",
    }


@pytest.fixture(scope="session")
def cpu_kernels_built() -> None:
    """The engine's C++ kernels built (or loaded) before a test runs a model. A process that finds them unbuilt
    builds them in the background and runs the torch path meanwhile (worker/engine/cpu_kernels.py); tests that
    count fused modules or compare the two paths need them there from the start, and every process a test
    starts then takes the same path."""
    from worker.engine import cpu_kernels

    cpu_kernels.kernels(wait=True)


@pytest.fixture(scope="session")
def tiny_llava_path(tmp_path_factory: pytest.TempPathFactory, cpu_kernels_built: None) -> Path:
    from worker.inference.tiny_model import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava", seed=0)


class ApiServer:
    """The real app under uvicorn on a loopback port, in a thread of the test process."""

    def __init__(self, settings: object, tenant: str = "default") -> None:
        import threading

        import uvicorn

        from api.main import create_app

        self.app = create_app(settings)  # type: ignore[arg-type]
        self.api_key = self.make_key(tenant) if settings.auth_required else "unused"  # type: ignore[attr-defined]
        self.headers = {"Authorization": f"Bearer {self.api_key}"}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def make_key(self, tenant: str) -> str:
        """A new API key of `tenant`, made as `vlmq apikey create` makes it."""
        from common.domain.apikeys import create_key

        with self.app.state.vlmq.db.session() as session:
            return create_key(session, tenant).key

    def client(self, api_key: str | None = None, **kwargs: object):
        """An httpx client for this server, authenticated as this server's tenant (or with `api_key`)."""
        import httpx

        headers = {"Authorization": f"Bearer {api_key or self.api_key}"}
        return httpx.Client(base_url=self.url, headers=headers, **{"timeout": 60, **kwargs})  # type: ignore[arg-type]

    def __enter__(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("API server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def service_env(pg_url: str, redis_url: str, s3_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, str]:
    """VLMQ_* environment for the service configuration: Postgres, Redis, S3 server."""
    from common.infra.migrate import upgrade

    upgrade(pg_url)
    return {
        "VLMQ_DATABASE_URL": pg_url,
        "VLMQ_BROKER_URL": redis_url,
        "VLMQ_DATA_DIR": str(tmp_path_factory.mktemp("vlmq-data")),
        **s3_env,
    }


def settings_from_env(env: dict[str, str], **overrides: object):
    """The Settings a process started with `env` (VLMQ_* variables) would read, with `overrides` on top."""
    from common.infra.settings import Settings

    values: dict[str, Any] = {k.removeprefix("VLMQ_").lower(): v for k, v in env.items() if k.startswith("VLMQ_")}
    return Settings(**{**values, **overrides})


@pytest.fixture(scope="session")
def compose_stack(s3_env: dict[str, str], tiny_llava_path: Path,
                  tmp_path_factory: pytest.TempPathFactory):
    """compose.yaml's services run as local processes (tests/stack.py), shared by the smoke and status-page tests."""
    from tests.stack import local_stack

    with local_stack(s3_env, tiny_llava_path, tmp_path_factory.mktemp("stack")) as stack:
        yield stack
