"""The `vlmq` command as a user runs it: migrate, an embedded API with its in-process worker, submit, status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from PIL import Image
from sqlalchemy import create_engine, inspect

from tests.conftest import free_port, wait_for_port


def _vlmq(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env["VLMQ_DATA_DIR"] = str(tmp_path / "state")
    return env


def test_migrate_creates_the_schema(tmp_path: Path) -> None:
    env = _clean_env(tmp_path)
    proc = _vlmq("migrate", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "latest revision" in proc.stdout
    engine = create_engine(f"sqlite:///{tmp_path / 'state' / 'vlmq.db'}")
    assert {"jobs", "images", "alembic_version"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_embedded_api_submit_wait_and_status(tmp_path: Path, tiny_llava_path: Path) -> None:
    """Also: `vlmq submit` without --max-tokens sends none, and the job gets the model's generation_config
    max_new_tokens (it sent 256 once, and the demo model spent them all on noise)."""
    import shutil

    model = shutil.copytree(tiny_llava_path, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 5}))
    tiny_llava_path = model
    env = _clean_env(tmp_path)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}"
    image_path = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (250, 10, 10)).save(image_path)
    log = (tmp_path / "api.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "api", "--port", str(port), "--model", str(tiny_llava_path)],
        # json: the INFO lines of our own loggers are written too, not only uvicorn's.
        env={**env, "VLMQ_LOG_FORMAT": "json"}, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, timeout=120, proc=server)
        proc = _vlmq("submit", "-i", str(image_path), "What colour is this?", "--wait", "--max-tokens", "6",
                     "--api-url", api_url, env=env)
        assert proc.returncode == 0, proc.stderr
        answer = proc.stdout.strip("\n")
        jobs = httpx.get(f"{api_url}/v1/jobs").json()["data"]
        assert len(jobs) == 1 and jobs[0]["status"] == "succeeded"
        assert jobs[0]["result"]["text"] == answer and jobs[0]["result"]["usage"]["completion_tokens"] == 6
        unbounded = _vlmq("submit", "-i", str(image_path), "And this?", "--wait", "--api-url", api_url, env=env)
        assert unbounded.returncode == 0, unbounded.stderr
        latest = httpx.get(f"{api_url}/v1/jobs").json()["data"][0]
        assert latest["result"]["usage"]["completion_tokens"] == 5
        status = _vlmq("status", jobs[0]["id"], "--api-url", api_url, env=env)
        assert status.returncode == 0 and json.loads(status.stdout)["status"] == "succeeded"
        missing = _vlmq("status", "job_missing", "--api-url", api_url, env=env)
        assert missing.returncode == 1 and "not found" in missing.stdout
        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not an image at all")
        refused = _vlmq("submit", "-i", str(bad), "hi", "--api-url", api_url, env=env)
        assert refused.returncode == 1 and "error 400" in refused.stderr
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    # Started up, the process froze its heap out of the garbage collector's scans (VLMQ_GC_FREEZE's default),
    # and so did the engine process it runs.
    text = (tmp_path / "api.log").read_text()
    frozen = re.search(r"start-up heap frozen: (\d+) objects", text)
    assert frozen and int(frozen[1]) > 50_000, text[-3000:]
    child = re.search(r"engine process \d+ ready: .*'gc_frozen_objects': (\d+)", text)
    assert child and int(child[1]) > 50_000, text[-3000:]




def test_a_folder_of_images_is_zipped_without_links_out_of_it(tmp_path: Path) -> None:
    import zipfile

    from common.images.archive import images_archive

    secret, folder = tmp_path / "secret.txt", tmp_path / "photos"
    secret.write_text("not for upload")
    (folder / "sub").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(folder / "sub" / "a.png")
    (folder / "out.png").symlink_to(secret)
    (folder / "inside.png").symlink_to(folder / "sub" / "a.png")
    with images_archive(folder) as archive, zipfile.ZipFile(archive) as zf:
        assert sorted(zf.namelist()) == ["inside.png", "sub/a.png"]


def test_batch_submit_refuses_metadata_that_is_not_key_value(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text("{}\n")
    proc = _vlmq("batch", "submit", str(lines), "--metadata", "oops", "--api-url", "http://127.0.0.1:9",
                 env=_clean_env(tmp_path), timeout=60)
    assert proc.returncode == 2 and "'oops' is not KEY=VALUE" in " ".join(proc.stderr.split()), proc.stderr


def test_an_api_that_cannot_be_reached_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text("{}\n")
    port = free_port()  # nothing listens there
    for args in (("batch", "submit", str(lines)), ("status", "job_x")):
        proc = _vlmq(*args, "--api-url", f"http://127.0.0.1:{port}", env=_clean_env(tmp_path), timeout=60)
        assert proc.returncode == 1 and "cannot reach the vlmq API" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_worker_that_stops_on_an_unrecoverable_error_exits_non_zero(tmp_path: Path) -> None:
    """Celery logs "Unrecoverable error" and stops the worker with status 1; `vlmq` used to drop that status
    and exit 0, so a supervisor restarting only failed processes left the worker down."""
    root = Path(__file__).resolve().parents[2]
    env = {**_clean_env(tmp_path), "VLMQ_TEST_FAULTS": "unrecoverable"}
    proc = subprocess.run([sys.executable, "-m", "tests.fault_worker", "ingest-worker"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert "Unrecoverable error" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1


def test_the_command_makes_openmp_threads_wait_passively_unless_told_otherwise() -> None:
    """An in-process engine's OpenMP threads spinning between parallel regions took the cores from the Python
    threads feeding it, and a `vlmq run` of tiny jobs went several times slower, at random."""
    script = "import os, cli.main; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "ACTIVE"
