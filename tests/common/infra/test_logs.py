"""JSON log lines and the ids they carry; the `vlmq healthcheck` probe and the process registry on Redis."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys

from common.infra.logs import FieldsFilter, JsonFormatter, log_fields
from common.infra.worker_registry import Heartbeat, WorkerRegistry


def capture() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(FieldsFilter())
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_json_lines_carry_context_fields_extras_and_exceptions() -> None:
    logger, stream = capture()
    with log_fields(batch_id="batch_1"):
        with log_fields(job_id="job_1"):
            logger.info("claimed %s", "it", extra={"attempt": 2, "detail": {"a": [1]}})
        try:
            raise ValueError("bad \"quote\"\nnewline")
        except ValueError:
            logger.exception("failed")
    logger.warning("outside")
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "claimed it" and first["level"] == "INFO" and first["logger"] == logger.name
    assert first["job_id"] == "job_1" and first["batch_id"] == "batch_1"
    assert first["attempt"] == 2 and first["detail"] == {"a": [1]}
    assert second["batch_id"] == "batch_1" and "job_id" not in second
    assert "ValueError: bad \"quote\"\nnewline" in second["exception"]
    assert "batch_id" not in third and third["ts"].endswith("+00:00")


def test_healthcheck_reads_this_hosts_record(redis_url: str) -> None:
    env = {"VLMQ_BROKER_URL": redis_url, "PATH": ""}

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", "healthcheck", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    assert probe("--role", "ingest").returncode == 1
    beat = Heartbeat(WorkerRegistry(redis_url), "ingest", 0.5, lambda: {"queue": "ingest"}).start()
    try:
        assert probe("--role", "ingest").returncode == 0
        assert probe("--role", "beat").returncode == 1
        record = next(r for r in WorkerRegistry(redis_url).list() if r["id"] == beat.id)
        assert record["host"] == socket.gethostname() and record["queue"] == "ingest"
    finally:
        beat.close()
    assert probe("--role", "ingest").returncode == 1  # removed on a clean stop (else it expires)
    bad = probe("--url", "http://127.0.0.1:9/readyz")
    assert bad.returncode == 1 and "unhealthy" in bad.stderr
