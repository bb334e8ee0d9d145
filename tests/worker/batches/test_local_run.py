"""`vlmq run` on embedded defaults (SQLite, in-process broker and worker, local folder), as a user runs it."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.api.test_jobs_api import data_url
from tests.hf_reference import hf_messages, hf_reference_answer
from tests.test_end_to_end import make_jobs
from worker.inference.model_loader import load_model


def _write_input(path: Path) -> list[dict]:
    bodies = make_jobs(12, seed=7)
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
             for i, b in enumerate(bodies)]
    rng = random.Random(3)
    text_only = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6}
    lines.append(json.dumps({"custom_id": "text-only", "method": "POST", "url": "/v1/chat/completions",
                             "body": text_only}))
    bodies.append(text_only)
    bad_image = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"definitely not an image")}},
        {"type": "text", "text": "hi"}]}], "max_tokens": 4}
    lines.append(json.dumps({"custom_id": "bad-image", "method": "POST", "url": "/v1/chat/completions",
                             "body": bad_image}))
    lines.append("{this is not json")
    lines.append("[" * 5000)  # past the parser's nesting: RecursionError, not ValueError
    lines.append(json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions",
                             "body": bodies[0]}))  # duplicate custom_id
    lines.append(json.dumps({"custom_id": "no-messages", "body": {"max_tokens": 3}}))
    del rng
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return bodies


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_vlmq_run_embedded_matches_hf(engine_process: str, tiny_llava_path: Path, tmp_path: Path) -> None:
    """Token for token against HF, with the engine in a child process (the default) and in the worker's own."""
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = _write_input(input_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env.update({"VLMQ_DATA_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "2",
                "VLMQ_ENGINE_PROCESS": engine_process})
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(input_path), "-o", str(output_path),
         "--model", str(tiny_llava_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "13 succeeded" in proc.stderr and "5 refused" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "state" / "vlmq.db").exists()  # embedded SQLite
    objects = tmp_path / "state" / "objects" / "tenants" / "default"
    assert any((objects / "files").iterdir())  # the input and output files, in the local folder
    assert not (objects / "results").exists()  # a batch row's result is its row: no object per row

    lines = [json.loads(line) for line in output_path.read_text().splitlines()]
    assert len(lines) == 18
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"] and line["response"]}
    loaded = load_model(str(tiny_llava_path))
    torch.manual_seed(0)
    ties = 0
    for i, body in enumerate(bodies):
        custom_id = "text-only" if i == len(bodies) - 1 else f"req-{i}"
        line = by_id[custom_id]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        completion = line["response"]["body"]
        assert completion["object"] == "chat.completion"
        images = [Image.open(io.BytesIO(_raw(p["image_url"]["url"]))).convert("RGB")
                  for m in body["messages"] if isinstance(m["content"], list)
                  for p in m["content"] if p["type"] == "image_url"]
        text, n_completion, n_prompt, near_tie = hf_reference_answer(
            loaded, hf_messages(body["messages"]), images, body["max_tokens"])
        assert completion["usage"]["prompt_tokens"] == n_prompt
        if near_tie and completion["choices"][0]["message"]["content"] != text:
            ties += 1  # HF itself was at a float-noise tie on some step; see tests/hf_reference.py
            continue
        assert completion["choices"][0]["message"]["content"] == text, custom_id
        assert completion["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                                       "total_tokens": n_prompt + n_completion}

    assert ties <= 1
    errors = [line for line in lines if line["error"] is not None]
    codes = sorted(e["error"]["code"] for e in errors)
    assert codes == ["duplicate_custom_id", "invalid_image", "invalid_json", "invalid_json", "invalid_request"]
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    # Output keeps input order.
    assert [line["custom_id"] for line in lines[:12]] == [f"req-{i}" for i in range(12)]


def _raw(url: str) -> bytes:
    import base64

    return base64.b64decode(url.split(",", 1)[1])


def test_vlmq_run_a_csv_manifest_with_a_folder_of_images(tiny_llava_path: Path, tmp_path: Path) -> None:
    """The native dataset path (manifest + images by relative path) through the same ingestion as batches."""
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    Image.new("RGB", (32, 24), (200, 20, 20)).save(photos / "red.png")
    Image.new("RGB", (24, 32), (20, 20, 200)).save(photos / "sub" / "blue.png")
    manifest = tmp_path / "rows.csv"
    manifest.write_text("custom_id,prompt,image,max_tokens\nr,What colour?,red.png,3\nb,And this?,sub/blue.png,3\n"
                        "gone,Where is it?,missing.png,3\n")
    output = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env.update({"VLMQ_DATA_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "2"})
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(manifest), "--images", str(photos), "-o", str(output),
         "--model", str(tiny_llava_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["r", "b", "gone"]  # input order
    assert [line["response"]["status_code"] for line in lines[:2]] == [200, 200]
    assert lines[2]["error"]["code"] == "image_not_found" and "missing.png" in lines[2]["error"]["message"]


def _run_cli(tiny_llava_path: Path, data_dir: Path, *args: str, wait: bool = True,
             **env_extra: str) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env.update({"VLMQ_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "2", **env_extra})
    command = [sys.executable, "-m", "cli.main", "run", *args, "--model", str(tiny_llava_path)]
    if wait:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_at_a_terminal)


def _ctrl_c_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT handled by default. A shell that starts a job in the background without
    job control (`nohup pytest ... &`, CI runners) sets it ignored, the child inherits that, Python then installs
    no KeyboardInterrupt handler, and Ctrl-C (SIGINT) would not reach `vlmq run` at all."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _flat(text: str) -> str:
    """The console's text with rich's line wrapping undone."""
    return " ".join(text.split())


def _succeeded(db_path: Path) -> int:
    import sqlite3

    if not db_path.exists():
        return 0
    try:
        with sqlite3.connect(db_path, timeout=1) as conn:
            return conn.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()[0]
    except sqlite3.OperationalError:  # not migrated yet, or busy
        return 0


def test_an_interrupted_run_carries_on_where_it_stopped(tiny_llava_path: Path, tmp_path: Path) -> None:
    """Ctrl-C, then the same command: the same batch goes on, finished requests are not run again, and the jobs
    the first process had sent into its (in-memory, now gone) broker or was running are not stranded, even
    with a dispatch window small enough that stranded jobs would fill it."""
    import signal
    import sqlite3
    import time

    lines = [json.dumps({"custom_id": f"q{i}", "body": {"messages": [{"role": "user", "content": f"count {i}"}],
                                                         "max_tokens": 24}}) for i in range(40)]
    source, output, state = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
    source.write_text("\n".join(lines) + "\n")
    window = {"VLMQ_DISPATCH_WINDOW": "4"}
    first = _run_cli(tiny_llava_path, state, str(source), "-o", str(output), wait=False, **window)
    assert isinstance(first, subprocess.Popen)
    deadline = time.monotonic() + 300
    while _succeeded(state / "vlmq.db") < 6:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-2000:]
    assert "run the same command again" in _flat(stderr) and not output.exists()
    with sqlite3.connect(state / "vlmq.db") as conn:
        kept = dict(conn.execute("SELECT custom_id, finished_at FROM jobs WHERE status = 'succeeded'").fetchall())
    assert 6 <= len(kept) < 40

    second = _run_cli(tiny_llava_path, state, str(source), "-o", str(output), **window)  # type: ignore[arg-type]
    assert isinstance(second, subprocess.CompletedProcess)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr and "40 succeeded" in _flat(second.stderr)
    out = [json.loads(line) for line in output.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(40)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    with sqlite3.connect(state / "vlmq.db") as conn:
        assert conn.execute("SELECT count(*) FROM batches").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 40
        again = dict(conn.execute("SELECT custom_id, finished_at FROM jobs").fetchall())
        assert conn.execute("SELECT count(*) FROM files").fetchone()[0] == 2  # input + output, no second copy
    assert all(again[cid] == finished for cid, finished in kept.items())  # not run a second time


def test_whole_file_failures_and_bad_outputs_are_errors(tiny_llava_path: Path, tmp_path: Path) -> None:
    import fcntl

    empty, output = tmp_path / "empty.jsonl", tmp_path / "out.jsonl"
    empty.write_text("")
    failed = _run_cli(tiny_llava_path, tmp_path / "s1", str(empty), "-o", str(output))
    assert isinstance(failed, subprocess.CompletedProcess)
    assert failed.returncode == 1 and "nothing in" in _flat(failed.stderr), failed.stderr[-2000:]
    assert "empty" in _flat(failed.stderr)

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}) + "\n")
    for bad_output, fragment in ((tmp_path, "is a directory"), (source, "is the input file"),
                                 (Path("/proc/vlmq/out.jsonl"), "cannot write the output")):
        refused = _run_cli(tiny_llava_path, tmp_path / "s2", str(source), "-o", str(bad_output))
        assert isinstance(refused, subprocess.CompletedProcess)
        assert refused.returncode == 2 and fragment in _flat(refused.stderr), refused.stderr[-2000:]
    assert source.read_text().startswith('{"custom_id": "a"')

    (tmp_path / "s3").mkdir()
    with (tmp_path / "s3" / "embedded.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a running `vlmq run` on that folder holds it
        busy = _run_cli(tiny_llava_path, tmp_path / "s3", str(source), "-o", str(output))
    assert isinstance(busy, subprocess.CompletedProcess)
    assert busy.returncode == 2 and "another vlmq process" in _flat(busy.stderr), busy.stderr[-2000:]


def test_expected_answers_come_from_the_stored_input(tmp_path: Path) -> None:
    """A BOM, a refused duplicate custom_id (the first line counts, as ingestion keeps it) and a pipe as input."""
    from common.infra.db import get_database
    from common.infra.migrate import upgrade
    from common.infra.settings import Settings
    from common.infra.storage import make_store
    from worker.batches.local_run import _expected_answers, _start_batch

    settings = Settings(data_dir=tmp_path, model="tiny", broker_url="memory://")
    upgrade(settings.database_url)
    db, store = get_database(settings.database_url), make_store(settings)
    rows = [{"custom_id": "a", "metadata": {"answer": "red"}}, {"custom_id": "b", "metadata": {"answer": "two"}},
            {"custom_id": "a", "metadata": {"answer": "blue"}}, {"custom_id": "c"}]
    read, write = os.pipe()
    with os.fdopen(write, "wb") as pipe:
        pipe.write(b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(r).encode() for r in rows) + b"\r\n")
    from rich.console import Console

    batch_id, resumed = _start_batch(db, store, settings, Path(f"/dev/fd/{read}"), None, Console(stderr=True))
    os.close(read)
    assert not resumed
    assert _expected_answers(db, store, settings, batch_id) == {"a": "red", "b": "two"}
    db.dispose()


def test_a_file_nothing_of_which_can_run_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """Empty, only lines that are not requests, a CSV without its columns: exit 1 with the reason, without
    importing torch (the model stack is made unimportable here, so a run that reached the model would fail
    with exit 2 instead); it took the model's load (16-34 s) before."""
    import time

    no_torch = Path(__file__).resolve().parents[2] / "no_torch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    env.update({"VLMQ_DATA_DIR": str(tmp_path / "state"),
                "PYTHONPATH": os.pathsep.join([str(no_torch), env.get("PYTHONPATH", "")])})
    cases = {"empty.jsonl": ("", "empty_file"), "blank.jsonl": ("\n  \n", "empty_file"),
             "junk.jsonl": ('{not json\n{"custom_id": "a"}\n', "invalid_json"),
             "rows.csv": ("question,picture\nhi,a.png\n", "invalid_manifest")}
    for name, (text, code) in cases.items():
        source, output = tmp_path / name, tmp_path / f"{name}.out"
        source.write_text(text)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "cli.main", "run", str(source), "-o", str(output)],
                              env=env, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
        assert proc.returncode == 1, (name, proc.stderr[-2000:])
        assert "nothing in" in _flat(proc.stderr) and code in proc.stderr, (name, proc.stderr[-2000:])
        assert elapsed < 30, (name, elapsed)  # generous: a shared 2-core machine; the model is never loaded
        refused = [json.loads(line) for line in output.read_text().splitlines()]
        assert all(r["error"]["code"] for r in refused)
        assert len(refused) == (2 if name == "junk.jsonl" else 0)
    assert not (tmp_path / "state").exists()  # no database, no object store


def test_a_short_file_runs_the_engine_in_this_process_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine child imports torch and loads the model a second time before its first step: a short run
    waits for that and never earns it back (bench/run_startup.py)."""
    from common.infra.settings import Settings
    from worker.batches.local_run import IN_PROCESS_ENGINE_LINES, run_settings

    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text("{}\n" * IN_PROCESS_ENGINE_LINES)
    long.write_text("{}\n" * (IN_PROCESS_ENGINE_LINES + 1))
    monkeypatch.delenv("VLMQ_ENGINE_PROCESS", raising=False)
    assert run_settings(Settings(data_dir=tmp_path), short).engine_process is False
    assert run_settings(Settings(data_dir=tmp_path), long).engine_process is True
    assert run_settings(Settings(data_dir=tmp_path), tmp_path).engine_process is True  # not a file: unknown size
    monkeypatch.setenv("VLMQ_ENGINE_PROCESS", "true")
    assert run_settings(Settings(data_dir=tmp_path), short).engine_process is True


def test_a_model_that_cannot_load_ends_the_run_with_its_error(tmp_path: Path) -> None:
    """The model loads beside the input's storing and queueing: its failure still ends the run at once, with
    the reason, rather than leaving the run waiting on jobs that cannot start."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}) + "\n")
    failed = _run_cli(tmp_path / "no-such-model", tmp_path / "state", str(source), "-o", str(output))
    assert isinstance(failed, subprocess.CompletedProcess)
    assert failed.returncode == 2 and "error" in _flat(failed.stderr), failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr, failed.stderr
