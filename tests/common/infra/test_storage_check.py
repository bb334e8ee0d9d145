"""A service process whose object store cannot be used says why in one line and exits 1 (common/infra/storage_check.py);
it crashed with an 82-line botocore traceback when the README's service block (which named no credentials) was
pasted as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.infra.settings import Settings
from common.infra.storage_check import object_store_problem
from tests.conftest import free_port


def _isolated_env(tmp_path: Path, **vlmq: str) -> dict[str, str]:
    """Nothing from this machine's AWS setup: botocore also reads AWS_* variables, ~/.aws and the instance
    metadata service."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
           "VLMQ_DATA_DIR": str(tmp_path / "state"), "VLMQ_STORAGE_BACKEND": "s3",
           "VLMQ_BROKER_URL": "redis://127.0.0.1:1/0", "VLMQ_MODEL": "vlmq-demo", **vlmq}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _start(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", command], env=env, capture_output=True, text=True,
                          timeout=120)


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1 and "Traceback" not in output and len(output.splitlines()) == 1, output[-3000:]
    assert output.startswith("error: object storage: ")
    return output


@pytest.mark.parametrize("command", ["api", "worker", "ingest-worker"])
def test_no_s3_credentials_is_one_line_at_start(command: str, s3_endpoint: str, tmp_path: Path) -> None:
    env = _isolated_env(tmp_path, VLMQ_S3_ENDPOINT_URL=s3_endpoint)
    line = _one_line_error(_start(command, env))
    assert "no S3 credentials" in line and "VLMQ_S3_ACCESS_KEY_ID" in line and "VLMQ_S3_SECRET_ACCESS_KEY" in line


def test_refused_credentials_and_a_missing_bucket_are_one_line(rclone_s3_endpoint: str, tmp_path: Path) -> None:
    """rclone's server checks the keys (moto accepts any)."""
    wrong = _isolated_env(tmp_path, VLMQ_S3_ENDPOINT_URL=rclone_s3_endpoint, VLMQ_S3_ACCESS_KEY_ID="testing",
                          VLMQ_S3_SECRET_ACCESS_KEY="not-the-secret")
    assert "refused the S3 credentials" in _one_line_error(_start("api", wrong))
    no_bucket = {**wrong, "VLMQ_S3_SECRET_ACCESS_KEY": "testing", "VLMQ_S3_CREATE_BUCKET": "false",
                 "VLMQ_S3_BUCKET": "never-created"}
    assert "'never-created' does not exist" in _one_line_error(_start("ingest-worker", no_bucket))


def test_an_endpoint_that_does_not_answer(s3_endpoint: str, tmp_path: Path) -> None:
    """Fatal where the process would create the bucket at start; otherwise it starts and waits S3 out."""
    settings = Settings(data_dir=tmp_path, storage_backend="s3", s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
                        s3_access_key_id="testing", s3_secret_access_key="testing")
    assert "cannot reach S3" in (object_store_problem(settings) or "")
    assert object_store_problem(settings.model_copy(update={"s3_create_bucket": False})) is None
    up = settings.model_copy(update={"s3_endpoint_url": s3_endpoint, "s3_bucket": "vlmq-check"})
    assert object_store_problem(up) is None  # and the bucket is created
    assert object_store_problem(up.model_copy(update={"s3_create_bucket": False})) is None
