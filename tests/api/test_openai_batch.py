"""The OpenAI Files + Batches API through the official `openai` client, on the real stack.

HTTP -> API (uvicorn) -> Postgres/S3 -> Redis -> a `vlmq ingest-worker` process (no model) ingests and
finalizes, a `vlmq worker --no-ingest` process runs the tiny LLaVA. Every answer must be the text HF
`generate` gives for that request alone.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import httpx
import openai
import pytest
import torch
from openai import OpenAI
from PIL import Image
from sqlalchemy import select, update

from common.broker.queue import make_celery, send_sweep_batches
from common.domain.models import Batch, Job, utcnow
from common.infra.db import get_database
from common.infra.settings import Settings
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import ApiServer, settings_from_env
from tests.hf_reference import hf_messages, hf_reference_answer
from tests.test_end_to_end import make_image, make_jobs
from worker.inference.model_loader import load_model

MAX_FILE_BYTES = 200 * 1024
FINAL = ("completed", "failed", "cancelled", "expired")


class Stack:
    def __init__(self, server: ApiServer, settings: Settings, env: dict[str, str], ingest_pid: int,
                 model_pid: int) -> None:
        self.url, self.settings, self.env, self.ingest_pid = server.url, settings, env, ingest_pid
        self.model_pid = model_pid
        self.server = server
        self.client = OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)
        self.http = server.client()

    def upload(self, lines: list[str], name: str = "batch.jsonl") -> str:
        return self.client.files.create(file=(name, ("\n".join(lines) + "\n").encode()), purpose="batch").id

    def run(self, lines: list[str], **kwargs: Any) -> Any:
        file_id = self.upload(lines)
        return self.client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h", **kwargs)

    def wait(self, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status}: {batch.request_counts}")
            time.sleep(0.2)

    def jsonl(self, file_id: str | None) -> list[dict[str, Any]]:
        assert file_id is not None
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()]

    def objects(self, prefix: str) -> dict[str, int]:
        """Key -> size of the stored objects under `prefix`."""
        s3 = boto3.client("s3", endpoint_url=self.settings.s3_endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        sizes: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.settings.s3_bucket, Prefix=prefix):
            sizes |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
        return sizes


@pytest.fixture(scope="module")
def stack(service_env: dict[str, str], tiny_llava_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    with running_stack(service_env, tiny_llava_path, tmp_path_factory.mktemp("batch-logs")) as running:
        yield running


@contextmanager
def running_stack(service_env: dict[str, str], tiny_llava_path: Path, logs: Path, **api_settings: Any
                  ) -> Iterator[Stack]:
    """An ingest worker and a model worker (the tiny LLaVA) in processes of their own, and the API."""
    env = {**os.environ, **service_env, "OMP_NUM_THREADS": "2", "VLMQ_WORKER_CONCURRENCY": "8",
           "VLMQ_MAX_FILE_BYTES": str(MAX_FILE_BYTES), "VLMQ_INGEST_CHUNK_ROWS": "10",
           # A window a little above the worker's 8 jobs in flight: one tenant keeps it busy, a second one
           # gets its turn within ~12 jobs.
           "VLMQ_DISPATCH_WINDOW": "12"}
    procs = []
    for name, args, extra in (("ingest", ["ingest-worker"], {}),
                              ("model", ["worker", "--no-ingest"], {"VLMQ_MODEL": str(tiny_llava_path)})):
        with (logs / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "cli.main", *args, "--loglevel", "WARNING"],
                                          env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT))
    settings = settings_from_env(service_env, model=str(tiny_llava_path), max_file_bytes=MAX_FILE_BYTES,
                                 **api_settings)
    try:
        with ApiServer(settings) as server:
            yield Stack(server, settings, env, procs[0].pid, procs[1].pid)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        for name in ("ingest", "model"):
            tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
            if "Traceback" in tail or "ERROR" in tail:
                print(f"--- {name} worker log ---\n{tail}")


def request_line(custom_id: str, body: dict[str, Any], **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body,
                       **extra})


def text_body(text: str, max_tokens: int = 1, image: bytes | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def test_uploads_expire_as_asked_and_the_sweep_deletes_them(stack: Stack) -> None:
    """files.create(expires_after=...) as OpenAI's client sends it; a time outside 1 hour..30 days is a 400.
    Once past it, the maintenance sweep deletes the file, unless a batch is still ingesting it."""
    from common.domain.file_expiry import delete_expired_files
    from common.domain.models import FileRecord, utcnow

    week: Any = {"anchor": "created_at", "seconds": 7 * 24 * 3600}  # the openai client's ExpiresAfter
    kept = stack.client.files.create(file=("kept.jsonl", b"{}\n"), purpose="batch")
    expiring = stack.client.files.create(file=("gone.jsonl", b"{}\n"), purpose="batch", expires_after=week)
    assert kept.expires_at is None and expiring.expires_at == expiring.created_at + week["seconds"]
    bads: list[Any] = [{"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": 3600}]
    for bad in bads:
        with pytest.raises(openai.BadRequestError, match="expires_after"):
            stack.client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch", expires_after=bad)
    flat = stack.http.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")},
                           data={"purpose": "batch", "expires_after": "3600"})
    assert flat.status_code == 400 and "expires_after[seconds]" in flat.json()["error"]["message"]
    db = stack.server.app.state.vlmq.db
    with db.session() as session:  # a week passes
        session.get(FileRecord, expiring.id).expires_at = utcnow()
    assert delete_expired_files(db, stack.server.app.state.vlmq.store) >= 1
    with pytest.raises(openai.NotFoundError):
        stack.client.files.retrieve(expiring.id)
    assert stack.client.files.retrieve(kept.id).id == kept.id


def test_batch_through_the_openai_client_matches_hf(stack: Stack, tiny_llava_path: Path) -> None:
    bodies = make_jobs(8, seed=11)
    bodies[1]["model"] = stack.settings.served_model_name
    lines = [request_line(f"req-{i}", b) for i, b in enumerate(bodies)]
    lines[3:3] = ["{this is not json"]
    lines.append(request_line("bad-image", text_body("hi", image=b"not an image at all")))
    lines.append(request_line("req-0", bodies[0]))  # duplicate custom_id
    lines.append(json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings",
                             "body": {"input": "x"}}))
    batch = stack.run(lines, metadata={"purpose": "e2e"},
                      output_expires_after={"anchor": "created_at", "seconds": 7 * 24 * 3600})
    assert batch.status == "validating" and batch.id.startswith("batch_") and batch.metadata == {"purpose": "e2e"}
    assert batch.endpoint == "/v1/chat/completions" and batch.completion_window == "24h"
    assert batch.expires_at == batch.created_at + 24 * 3600

    done = stack.wait(batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 8, 4)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.failed_at is None
    output = stack.jsonl(done.output_file_id)
    errors = stack.jsonl(done.error_file_id)
    out_file = stack.client.files.retrieve(done.output_file_id or "")
    assert out_file.purpose == "batch_output" and out_file.filename == f"{batch.id}_output.jsonl"
    error_file = stack.client.files.retrieve(done.error_file_id or "")
    for written in (out_file, error_file):  # output_expires_after: a week after each was written
        assert written.expires_at == written.created_at + 7 * 24 * 3600
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_custom_id", "invalid_image", "invalid_json",
                                                           "invalid_url"]
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    assert {e["custom_id"] for e in errors} == {None, "bad-image", "req-0", "wrong-url"}

    by_id = {o["custom_id"]: o for o in output}
    assert sorted(by_id) == sorted(f"req-{i}" for i in range(8))
    loaded = load_model(str(tiny_llava_path))
    torch.manual_seed(0)
    ties = 0
    usage = [0, 0]
    for i, body in enumerate(bodies):
        line = by_id[f"req-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["id"].startswith("batch_req_")
        completion = line["response"]["body"]
        assert completion["object"] == "chat.completion" and completion["model"] == stack.settings.served_model_name
        images = [Image.open(io.BytesIO(_raw(p["image_url"]["url"]))).convert("RGB")
                  for m in body["messages"] if isinstance(m["content"], list)
                  for p in m["content"] if p["type"] == "image_url"]
        text, n_completion, n_prompt, near_tie = hf_reference_answer(
            loaded, hf_messages(body["messages"]), images, body["max_tokens"])
        usage[0] += completion["usage"]["prompt_tokens"]
        usage[1] += completion["usage"]["completion_tokens"]
        assert completion["usage"]["prompt_tokens"] == n_prompt
        if near_tie and completion["choices"][0]["message"]["content"] != text:
            ties += 1  # HF itself was at a float-noise tie on some step; see tests/hf_reference.py
            continue
        assert completion["choices"][0]["message"]["content"] == text, f"req-{i}"
        assert completion["usage"]["completion_tokens"] == n_completion
    assert ties <= 1
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == tuple(usage)


def test_two_tenants_share_the_worker_and_batches_show_an_eta(stack: Stack) -> None:
    other = OpenAI(base_url=stack.url + "/v1", api_key=stack.server.make_key("tenant-b"), max_retries=0)
    # Big enough that tenant a is still running when tenant b's small file has been ingested, on a fast CPU too.
    big = stack.run([request_line(f"a{i}", text_body(f"tenant a row {i}", max_tokens=24)) for i in range(240)])
    stack.wait(big.id, ("in_progress", *FINAL))
    file_id = other.files.create(file=("b.jsonl", "\n".join(
        request_line(f"b{i}", text_body(f"tenant b row {i}", max_tokens=24)) for i in range(6)).encode()),
        purpose="batch").id
    small = other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    eta_seen = False
    deadline = time.monotonic() + 120
    while (done := other.batches.retrieve(small.id)).status not in FINAL:
        assert time.monotonic() < deadline
        running = stack.client.batches.retrieve(big.id).model_dump()
        eta_seen |= running["status"] == "in_progress" and running["estimated_completion_at"] is not None
        time.sleep(0.1)
    assert done.status == "completed" and done.request_counts.completed == 6  # type: ignore[union-attr]
    # Tenant b's 6 rows ran alongside tenant a's, not after all 240 of them.
    first = stack.client.batches.retrieve(big.id)
    assert first.request_counts.completed <= 180, first.request_counts  # type: ignore[union-attr]
    finished = stack.wait(big.id).model_dump()
    assert finished["status"] == "completed", finished
    assert finished["request_counts"]["completed"] == 240, stack.jsonl(finished["error_file_id"])
    assert finished["estimated_completion_at"] is None
    assert eta_seen and finished["completion_rate"] is None
    with pytest.raises(openai.NotFoundError):  # and neither sees the other's batch
        other.batches.retrieve(big.id)


def test_each_distinct_image_is_stored_once(stack: Stack) -> None:
    images = [png_bytes((17, 200 + i, 3), (11 + i, 13)) for i in range(3)]
    images_before, packs_before = stack.objects("images/"), stack.objects("packs/")
    lines = [request_line(f"dedup-{i}", text_body(f"look {i}", image=images[i % 3])) for i in range(24)]
    done = stack.wait(stack.run(lines).id)
    assert done.status == "completed" and done.request_counts.completed == 24
    # Stored once each, side by side in the ingestion's packs, not as objects of their own.
    new_packs = {k: v for k, v in stack.objects("packs/").items() if k not in packs_before}
    assert stack.objects("images/") == images_before and sum(new_packs.values()) == sum(map(len, images))


def test_cancel_keeps_finished_results_and_single_jobs_outrank_batches(stack: Stack) -> None:
    # Several times the jobs the dispatch window lets run at once: the cancel must find queued ones on a fast CPU.
    lines = [request_line(f"slow-{i}", text_body(f"tell a long story number {i}", max_tokens=48))
             for i in range(80)]
    batch = stack.wait(stack.run(lines).id, ("in_progress", *FINAL))
    assert batch.status == "in_progress", batch
    single = stack.http.post("/v1/jobs", json=text_body("single job", max_tokens=2))
    assert single.status_code == 202, single.text
    job_id = single.json()["id"]
    deadline = time.monotonic() + 60
    while (job := stack.http.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert job["status"] == "succeeded" and job["priority"] == 5
    cancelled = stack.client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    done = stack.wait(batch.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    # The rows the worker was running were cancelled with the batch (the worker, told through Redis, aborted
    # them): none ran on to its end, as all its VLMQ_WORKER_CONCURRENCY did before. Only rows it claimed after,
    # before the ingest worker's cancel task reached them, might have.
    in_flight = int(stack.env["VLMQ_WORKER_CONCURRENCY"])
    assert done.request_counts and cancelled.request_counts
    assert done.request_counts.completed - cancelled.request_counts.completed < in_flight, (
        cancelled.request_counts, done.request_counts)
    with get_database(stack.settings.database_url).session() as session:
        rows = session.execute(select(Job.status, Job.result_text).where(Job.batch_id == batch.id)).all()
    assert {status for status, _ in rows} <= {"succeeded", "cancelled"}
    assert all(text is None for status, text in rows if status == "cancelled")  # no result kept for those
    output = stack.jsonl(done.output_file_id) if done.output_file_id else []
    errors = stack.jsonl(done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}, errors
    # Every request is in exactly one file; the single job, sent after the batch, ran before these.
    assert sorted(x["custom_id"] for x in output + errors) == sorted(f"slow-{i}" for i in range(80))
    assert done.request_counts.completed == len(output) < 80
    assert stack.client.batches.cancel(batch.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.ConflictError, match="can no longer be cancelled"):
        stack.client.batches.cancel(stack.wait(stack.run([request_line("x", text_body("x"))]).id).id)


def test_expired_batch_keeps_finished_results(stack: Stack) -> None:
    # Many more jobs than the worker runs at once (its dispatch window is 12), so when the first has finished
    # most are still open: a fixed sleep raced a fast CPU, which finished all of them before the sweep.
    lines = [request_line(f"late-{i}", text_body(f"a long answer please {i}", max_tokens=48)) for i in range(120)]
    batch = stack.wait(stack.run(lines).id, ("in_progress", *FINAL))
    assert batch.status == "in_progress", batch
    deadline = time.monotonic() + 60
    while ((counts := (batch := stack.client.batches.retrieve(batch.id)).request_counts) is None
           or counts.completed == 0):
        assert time.monotonic() < deadline and batch.status == "in_progress", batch
        time.sleep(0.02)
    with get_database(stack.settings.database_url).session() as session:  # its 24 h window is over
        session.execute(update(Batch).where(Batch.id == batch.id).values(expires_at=utcnow() - timedelta(seconds=1)))
    send_sweep_batches(make_celery(stack.settings), stack.settings)  # what beat sends every minute
    done = stack.wait(batch.id)
    assert done.status == "expired" and done.expired_at and done.completed_at is None, done
    output = stack.jsonl(done.output_file_id) if done.output_file_id else []
    errors = stack.jsonl(done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sorted(x["custom_id"] for x in output + errors) == sorted(f"late-{i}" for i in range(120))
    assert done.request_counts.completed == len(output) > 0


def test_native_dataset_zip_in_one_request_and_tar_in_two_match_hf(stack: Stack, tiny_llava_path: Path) -> None:
    rng = random.Random(5)
    pictures = {f"pics/p{i}.{ext}": make_image(rng) for i, ext in enumerate(["png", "jpg", "webp"])}
    rows = [(f"r{i}", [f"pics/p{i % 3}.{['png', 'jpg', 'webp'][i % 3]}"], f"what is in picture {i}", 3 + i)
            for i in range(4)]
    rows[3][1].append("pics/p0.png")  # two images in one request
    csv_text = "custom_id,image,prompt,max_tokens\n" + "".join(
        f"{cid},{'|'.join(paths)},{prompt},{n}\n" for cid, paths, prompt, n in rows)
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as zf:  # a zip of a folder: members are "dataset/pics/..."
        for name, data in pictures.items():
            zf.writestr(f"dataset/{name}", data)
    one_request = stack.http.post("/v1/datasets", data={"metadata": json.dumps({"kind": "csv+zip"})},
                                  files={"manifest": ("rows.csv", csv_text.encode()),
                                         "images": ("pics.zip", zipped.getvalue())})
    assert one_request.status_code == 200, one_request.text
    assert one_request.json()["images_file_id"] and one_request.json()["metadata"] == {"kind": "csv+zip"}

    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w:gz") as tf:
        for name, data in pictures.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    bodies: dict[str, dict[str, Any]] = {cid: {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": p}} for p in paths), {"type": "text", "text": prompt}]}],
        "max_tokens": n} for cid, paths, prompt, n in rows}
    images_id = stack.client.files.create(file=("pics.tar.gz", tarred.getvalue()), purpose="batch").id
    two_uploads = stack.client.batches.create(
        input_file_id=stack.upload([request_line(cid, body) for cid, body in bodies.items()]),
        endpoint="/v1/chat/completions", completion_window="24h", extra_body={"images_file_id": images_id})

    answers = []
    for batch_id in (one_request.json()["id"], two_uploads.id):
        done = stack.wait(batch_id)
        assert done.status == "completed" and done.request_counts.completed == 4, done
        answers.append({o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
                        for o in stack.jsonl(done.output_file_id)})
    loaded = load_model(str(tiny_llava_path))
    ties = 0
    for cid, body in bodies.items():
        images = [Image.open(io.BytesIO(pictures[p["image_url"]["url"]])).convert("RGB")
                  for p in body["messages"][0]["content"] if p["type"] == "image_url"]
        text, _, _, near_tie = hf_reference_answer(loaded, hf_messages(body["messages"]), images, body["max_tokens"])
        for got in answers:
            if got[cid] != text and near_tie:
                ties += 1
                continue
            assert got[cid] == text, cid
    assert ties <= 1


def test_cli_batch_submit_wait_status_results(stack: Stack, tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    (photos / "a.png").write_bytes(png_bytes((5, 6, 7)))
    (photos / "sub" / "b.png").write_bytes(png_bytes((7, 6, 5)))
    manifest = tmp_path / "rows.csv"
    manifest.write_text("prompt,image,max_tokens\nfirst,a.png,2\nsecond,sub/b.png|a.png,2\nthird,,1\n"
                        "missing,nope.png,1\n")
    env = {**stack.env, "VLMQ_API_URL": stack.url}

    def vlmq(*args: str, group: str = "batch") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", group, *args], env=env, capture_output=True,
                              text=True, timeout=120)

    assert vlmq("submit", str(manifest)).returncode == 1  # no key: the API refuses
    created = vlmq("create", "--tenant", "cli-user", "--name", "laptop", group="apikey")
    assert created.returncode == 0, created.stderr
    env["VLMQ_API_KEY"] = created.stdout.strip()

    submitted = vlmq("submit", str(manifest), "--images", str(photos), "--wait", "--metadata", "by=cli")
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    batch = json.loads(submitted.stdout)
    assert batch["status"] == "completed" and batch["metadata"] == {"by": "cli"}
    assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert json.loads(vlmq("status", batch["id"]).stdout)["id"] == batch["id"]
    fetched = vlmq("results", batch["id"], "-o", str(tmp_path / "out.jsonl"))
    assert fetched.returncode == 0, fetched.stderr
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines if x["error"] is None) == ["line-2", "line-3", "line-4"]
    assert [x["error"]["code"] for x in lines if x["error"]] == ["image_not_found"]


def test_list_pagination(stack: Stack) -> None:
    ids = [stack.run([request_line("p", text_body(f"page {i}"))]).id for i in range(3)]
    listed = [b.id for b in stack.client.batches.list(limit=2)]  # the client follows `after` page by page
    assert listed == sorted(listed, reverse=True) and len(set(listed)) == len(listed)
    assert listed[:3] == ids[::-1]
    page = stack.http.get("/v1/batches", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True and len(page["data"]) == 2
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    last = stack.http.get("/v1/batches", params={"limit": 2, "after": ids[1]}).json()
    assert last["data"][0]["id"] == ids[0]
    files = [f.id for f in stack.client.files.list(limit=2, purpose="batch")]
    assert files == sorted(files, reverse=True) and len(files) >= 3
    oldest_first = [f.id for f in stack.client.files.list(limit=2, order="asc")]
    assert oldest_first == sorted(oldest_first)
    for batch_id in ids:
        assert stack.wait(batch_id).status == "completed"


def test_file_lifecycle_and_delete(stack: Stack) -> None:
    file_id = stack.upload([request_line("a", text_body("a"))], name="mine.jsonl")
    info = stack.client.files.retrieve(file_id)
    assert (info.object, info.purpose, info.filename, info.status) == ("file", "batch", "mine.jsonl", "processed")
    assert info.id.startswith("file-") and info.bytes == len(stack.client.files.content(file_id).content)
    # A presigned URL downloads the same bytes straight from object storage, without a key, for a while.
    presigned = stack.http.get(f"/v1/files/{file_id}/url", params={"expires_in": 60}).json()
    assert presigned["expires_at"] - time.time() <= 61
    assert httpx.get(presigned["url"]).content == stack.client.files.content(file_id).content
    capped = stack.http.get(f"/v1/files/{file_id}/url", params={"expires_in": 10**9}).json()
    assert capped["expires_at"] - time.time() <= stack.settings.presign_expiry_seconds + 1
    # The signature itself (SigV4, which every S3 region takes) expires then: signed at X-Amz-Date, for
    # X-Amz-Expires seconds.
    params = httpx.URL(presigned["url"]).params
    assert params["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
    signed_at = datetime.strptime(params["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).timestamp()
    assert abs(signed_at + int(params["X-Amz-Expires"]) - presigned["expires_at"]) <= 2
    deleted = stack.client.files.delete(file_id)
    assert (deleted.id, deleted.deleted, deleted.object) == (file_id, True, "file")
    with pytest.raises(openai.NotFoundError, match="no such file"):
        stack.client.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        stack.client.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        stack.client.files.delete(file_id)


def test_batches_that_cannot_run_fail(stack: Stack) -> None:
    done = stack.wait(stack.run(["{nope", request_line("x", {"messages": []})]).id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [(1, "invalid_json"), (2, "invalid_request")]
    assert done.request_counts.total == 2 and done.request_counts.failed == 2


def test_bad_requests_are_4xx_with_a_message(stack: Stack) -> None:
    good = stack.upload([request_line("a", text_body("a"))])
    client = stack.client
    with pytest.raises(openai.NotFoundError, match="no such file"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="vlmq batches run /v1/chat/completions only"):
        client.batches.create(input_file_id=good, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window '48h' is not supported"):
        client.batches.create(input_file_id=good, endpoint="/v1/chat/completions",
                              completion_window="48h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not supported"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError, match="larger than this server's limit") as too_big:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(input_file_id=good, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={f"k{i}": "v" for i in range(17)})
    outputs = client.files.list(purpose="batch_output").data
    if not outputs:  # this test run alone: make one
        stack.wait(stack.run([request_line("o", text_body("o"))]).id)
        outputs = client.files.list(purpose="batch_output").data
    output_file = outputs[0].id
    with pytest.raises(openai.BadRequestError, match="needs purpose 'batch'"):
        client.batches.create(input_file_id=output_file, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no such batch"):
        client.batches.retrieve("batch_nope")
    files_before = {f.id for f in client.files.list()}
    no_manifest = stack.http.post("/v1/datasets", files={"images": ("a.zip", b"PK\x05\x06" + b"\0" * 18)})
    assert no_manifest.status_code == 400 and "'manifest'" in no_manifest.json()["error"]["message"]
    bad_metadata = stack.http.post("/v1/datasets", data={"metadata": "[1]"}, files={"manifest": ("m.jsonl", b"{}")})
    assert bad_metadata.status_code == 400 and "metadata" in bad_metadata.json()["error"]["message"]
    assert {f.id for f in client.files.list()} == files_before  # refused uploads leave no files behind
    missing_file = stack.http.post("/v1/files", data={"purpose": "batch"})
    assert missing_file.status_code in (400, 415) and missing_file.json()["error"]["message"]


def test_embedded_mode_runs_batches(tiny_llava_path: Path, tmp_path: Path) -> None:
    """SQLite, the in-process broker and worker, a local object folder."""
    from common.infra.migrate import upgrade
    from worker.context import get_context, set_context
    from worker.embedded import embedded_worker

    settings = Settings(data_dir=tmp_path, model=str(tiny_llava_path), broker_url="memory://")
    upgrade(settings.database_url)
    app = make_celery(settings)
    try:
        with embedded_worker(app, settings), ApiServer(settings) as server:
            server.app.state.vlmq.celery = app  # as `vlmq api` does: one in-memory broker for both
            client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            lines = [request_line(f"e{i}", text_body(f"embedded {i}", max_tokens=2)) for i in range(3)]
            file_id = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch").id
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 60
            while (batch := client.batches.retrieve(batch.id)).status not in FINAL:
                assert time.monotonic() < deadline, batch
                time.sleep(0.2)
            assert batch.status == "completed" and batch.request_counts.completed == 3  # type: ignore[union-attr]
            assert len(client.files.content(batch.output_file_id or "").text.splitlines()) == 3
            local = httpx.get(f"{server.url}/v1/files/{batch.output_file_id}/url")
            assert local.status_code == 409 and "/content" in local.json()["error"]["message"]
            # A cancel is not queued behind the jobs already sent: batch tasks have a queue of their own, which
            # the worker takes from in turn with the model's (the in-memory broker ignores priorities, so on the
            # model's queue the cancel waited for every job sent before it).
            lines = [request_line(f"c{i}", text_body(f"cancel me {i}", max_tokens=24)) for i in range(400)]
            file_id = client.files.create(file=("many.jsonl", "\n".join(lines).encode()), purpose="batch").id
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while (batch := client.batches.retrieve(batch.id)).request_counts.completed < 8:  # type: ignore[union-attr]
                assert time.monotonic() < deadline + 60, batch
                time.sleep(0.05)
            at_cancel = client.batches.cancel(batch.id).request_counts.completed  # type: ignore[union-attr]
            while (batch := client.batches.retrieve(batch.id)).status not in FINAL:
                assert time.monotonic() < deadline + 120, batch
                time.sleep(0.2)
            assert batch.status == "cancelled", batch
            # The rows the worker had claimed (up to 2 x max_num_seqs, most waiting in its engine) were cancelled
            # with the batch and aborted, not run to their end (all of them once finished after the cancel). Only
            # rows claimed after it, before the cancel task reached the queued ones, could still finish: fewer than
            # one run_job message's worth, as the aborts free the worker to take that task at once.
            assert batch.request_counts.completed - at_cancel < settings.job_ids_per_message, (  # type: ignore[union-attr]
                at_cancel, batch.request_counts)
    finally:
        get_context().close()
        set_context(None)


def test_the_ingest_worker_never_loaded_torch(stack: Stack) -> None:
    maps = Path(f"/proc/{stack.ingest_pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    assert "libtorch" not in maps.read_text()


def _raw(url: str) -> bytes:
    import base64

    return base64.b64decode(url.split(",", 1)[1])
