"""Batch ingestion, cancellation and finalization on Postgres and the S3 server, without a model or broker.

Jobs are driven through common.domain.jobs (the state machine a worker uses); dispatch is a callback recording the
job ids a chunk sent, so a test can fail it to play a crash between commit and dispatch.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from sqlalchemy import event, func, select

from common.domain import batches, jobs
from common.domain.batch_input import iter_lines
from common.domain.files import add_file, file_key, open_reader
from common.domain.models import Batch, BatchLineError, FileRecord, Job, new_file_id
from common.domain.views import chat_completion
from common.images.pack import PACK_PREFIX
from common.images.stored import owned_image, owned_images, store_image
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store, result_key
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import held_redis_db, settings_from_env
from worker.batches.finalize import cancel_batch_jobs, due_batches, expire_batch, expire_due, finalize_batch
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.jobs.image_reader import ImageReader, image_refs

MODEL = "tiny-ingest"


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", ingest_chunk_rows=3, max_body_bytes=64 * 1024)


class Recorder:
    def __init__(self, fail_on_call: int | None = None, hook: Callable[[int], None] | None = None) -> None:
        self.sent: list[str] = []
        self.calls = 0
        self.fail_on_call, self.hook = fail_on_call, hook

    def __call__(self, model_settings: Settings, job_ids: list[str], priority: int) -> None:
        self.calls += 1
        assert model_settings.job_queue == f"jobs.{MODEL}" and priority == 2
        if self.calls == self.fail_on_call:
            raise ConnectionError("broker went away")
        self.sent += job_ids
        if self.hook is not None:
            self.hook(self.calls)


def line(custom_id: str, text: str = "hi", image: bytes | None = None, **body: Any) -> str:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                "max_tokens": 3, **body}})


def make_batch(db: Database, store: ObjectStore, data: bytes) -> str:
    file_id = new_file_id()
    store.put(file_key(file_id, "default"), data)
    with db.session() as session:
        add_file(session, file_id=file_id, key=file_key(file_id, "default"), size=len(data), filename="in.jsonl",
                 purpose="batch", tenant="default")
        return batches.create_batch(session, input_file_id=file_id, endpoint="/v1/chat/completions",
                                    completion_window="24h", model=MODEL, metadata=None).id


def get_batch(db: Database, batch_id: str) -> Batch:
    with db.session() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        return batch


def line_errors(db: Database, batch_id: str) -> list[tuple[int, str | None, str]]:
    with db.session() as session:
        rows = session.scalars(select(BatchLineError).where(BatchLineError.batch_id == batch_id)
                               .order_by(BatchLineError.line))
        return [(e.line, e.custom_id, e.code) for e in rows]


def batch_jobs(db: Database, batch_id: str) -> list[Job]:
    with db.session() as session:
        return list(session.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.id)))


def test_iter_lines_is_bounded_and_exact() -> None:
    data = b"\xef\xbb\xbf{\"a\": 1}\r\n\n   \n" + b"x" * 50 + b"\n\xff\xfe\nlast"
    for piece in (1, 7, len(data)):  # chunk boundaries anywhere
        chunks = [data[i:i + piece] for i in range(0, len(data), piece)]
        got = [(n, item if isinstance(item, str) else item.code) for n, item in iter_lines(chunks, 20)]
        assert got == [(1, '{"a": 1}'), (4, "line_too_long"), (5, "invalid_utf8"), (6, "last")]


def test_ingest_checks_every_line_in_chunks(settings: Settings, db: Database, store: ObjectStore) -> None:
    red, blue = png_bytes((250, 1, 1), (9, 7)), png_bytes((1, 1, 250), (7, 9))
    lines = [
        line("a", image=red), line("b", image=blue), line("c", image=red),  # chunk 1: two distinct images
        "{not json", line("d", image=blue), line("a", text="dup of chunk 1"),  # chunk 2
        "", line("e", image=b"junk"), line("e"),  # bad image, then its custom_id again
        line("f", model="gpt-7"), json.dumps({"custom_id": "g", "url": "/v1/embeddings", "body": {}}),
        line("h"), line("h"),  # duplicate inside one chunk
    ]
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    sent = Recorder()
    status = ingest_batch(batch_id, IngestDeps(settings, db, store, sent))
    assert status == "in_progress"
    batch = get_batch(db, batch_id)
    assert (batch.total_requests, batch.refused_requests, batch.ingested_lines) == (12, 7, 13)
    assert line_errors(db, batch_id) == [
        (4, None, "invalid_json"), (6, "a", "duplicate_custom_id"), (8, "e", "invalid_image"),
        (9, "e", "duplicate_custom_id"), (10, "f", "model_not_found"), (11, "g", "invalid_url"),
        (13, "h", "duplicate_custom_id"),
    ]
    created = batch_jobs(db, batch_id)
    assert sorted(j.custom_id or "" for j in created) == ["a", "b", "c", "d", "h"]
    assert all(j.status == "queued" and j.priority == settings.batch_priority and j.model == MODEL for j in created)
    assert sorted(sent.sent) == sorted(j.id for j in created) and sent.calls == 3  # chunks with jobs
    parts = [p for j in created for m in j.request["messages"] for p in m["content"] if p["type"] == "image"]
    assert {p["image_id"] for p in parts} == {hashlib.sha256(red).hexdigest(), hashlib.sha256(blue).hexdigest()}
    reader = ImageReader(store)  # each job's images read back from where its request says (checked by hash)
    assert {reader.read(ref) for job in created for ref in image_refs(job.request)} == {red, blue}
    # A duplicate delivery of the task changes nothing.
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert len(batch_jobs(db, batch_id)) == 5


def test_each_chunks_new_images_are_written_as_one_pack(settings: Settings, db: Database, store: ObjectStore,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seed = uuid.uuid4().bytes  # images no other test stored: image rows are shared by the whole run
    pictures = [png_bytes((seed[0], seed[1], i), (5 + i, 4)) for i in range(7)]
    lines = [line(f"p{i}", image=picture) for i, picture in enumerate(pictures)]
    lines.insert(4, line("again", image=pictures[0]))  # met in an earlier chunk: named where it lies already
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    puts: list[str] = []
    put = store.put
    monkeypatch.setattr(store, "put", lambda key, data, content_type="": puts.append(key) or put(key, data))  # type: ignore[func-returns-value]
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert len(puts) == 3 and all(key.startswith(PACK_PREFIX) for key in puts)  # chunks of 3 lines, 3 and 2 new
    created = {job.custom_id: job for job in batch_jobs(db, batch_id)}
    reader = ImageReader(store)
    # Lines p0-p2 are the first chunk, p3, again, p4 the second, p5-p6 the third.
    for i, (picture, chunk) in enumerate(zip(pictures, [0, 0, 0, 1, 1, 2, 2], strict=True)):
        [ref] = image_refs(created[f"p{i}"].request)
        assert ref.pack is not None and ref.pack.key == puts[chunk]
        assert reader.read(ref) == picture
    assert image_refs(created["again"].request) == image_refs(created["p0"].request)


def test_ingest_resumes_after_a_crash_without_duplicates(settings: Settings, db: Database,
                                                         store: ObjectStore) -> None:
    data = ("\n".join(line(f"r{i}") for i in range(8)) + "\n{bad\n").encode()
    batch_id = make_batch(db, store, data)
    first = Recorder(fail_on_call=2)
    with pytest.raises(ConnectionError):  # chunk 2 committed, then its dispatch failed
        ingest_batch(batch_id, IngestDeps(settings, db, store, first))
    batch = get_batch(db, batch_id)
    assert batch.status == "validating" and batch.ingested_lines == 6
    assert len(first.sent) == 3 and all(j.dispatched_at is None for j in batch_jobs(db, batch_id)[3:])
    again = Recorder()
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, again)) == "in_progress"
    created = batch_jobs(db, batch_id)
    assert sorted(j.custom_id or "" for j in created) == [f"r{i}" for i in range(8)]
    assert line_errors(db, batch_id) == [(9, None, "invalid_json")]
    # The failed send left chunk 2 unsent, so the resumed run sent it: every job exactly once.
    assert sorted(first.sent + again.sent) == sorted(j.id for j in created)
    assert all(j.dispatched_at is not None for j in created)
    assert get_batch(db, batch_id).total_requests == 9


def test_a_second_ingester_stops_when_the_first_moves_on(settings: Settings, db: Database,
                                                         store: ObjectStore) -> None:
    batch_id = make_batch(db, store, ("\n".join(line(f"s{i}") for i in range(7)) + "\n").encode())

    def other_ingester_moves(calls: int) -> None:
        with db.session() as session:
            session.get(Batch, batch_id).ingested_lines = 5  # type: ignore[union-attr]

    status = ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder(hook=other_ingester_moves)))
    assert status == "validating"
    assert len(batch_jobs(db, batch_id)) == 3 and not line_errors(db, batch_id)


@pytest.mark.parametrize(("content", "code"), [
    (b"{nope\n[1]\n" + line("x", max_tokens=0).encode() + b"\n", "invalid_json"),
    (b"\n\n", "empty_file"),
    (None, "file_unreadable"),
])
def test_batches_that_cannot_run_fail_with_errors(settings: Settings, db: Database, store: ObjectStore,
                                                  content: bytes | None, code: str) -> None:
    batch_id = make_batch(db, store, content or b"x")
    if content is None:
        with db.session() as session:
            store.delete(session.get(FileRecord, get_batch(db, batch_id).input_file_id).object_key)  # type: ignore[union-attr]
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "failed"
    batch = get_batch(db, batch_id)
    assert batch.failed_at is not None and batch.errors and batch.errors[0]["code"] == code
    if code == "invalid_json":
        assert [(e["line"], e["code"]) for e in batch.errors] == [(1, "invalid_json"), (2, "invalid_line"),
                                                                 (3, "invalid_request")]
        assert "max_tokens" in batch.errors[2]["message"]
        # Every refused line also has its line in an error file, as in a batch that ran.
        assert finalize_batch(batch_id, db, store) == "failed"
        batch = get_batch(db, batch_id)
        assert batch.output_file_id is None and batch.error_file_id is not None
        lines = _read_jsonl(store, db, batch.error_file_id)
        assert [line["error"]["code"] for line in lines] == ["invalid_json", "invalid_line", "invalid_request"]
        assert finalize_batch(batch_id, db, store) == "failed"  # a second run attaches nothing more
        assert get_batch(db, batch_id).error_file_id == batch.error_file_id
    else:
        assert finalize_batch(batch_id, db, store) == "failed" and get_batch(db, batch_id).error_file_id is None


def _finish(db: Database, store: ObjectStore, job: Job, text: str) -> None:
    body = chat_completion(job.id, job.model, 0, text, "stop", 5, 2)
    store.put(result_key(job.id, job.tenant), json.dumps(body).encode())
    with db.session() as session:
        assert jobs.claim(session, job.id, "w", 60)
        assert jobs.finish(session, job.id, "w", jobs.JobResult(result_key(job.id, job.tenant), text, "stop", 5, 2))


def _read_jsonl(store: ObjectStore, db: Database, file_id: str) -> list[dict[str, Any]]:
    with db.session() as session:
        key = session.get(FileRecord, file_id).object_key  # type: ignore[union-attr]
    return [json.loads(x) for x in b"".join(open_reader(store, key)).decode().splitlines()]


def test_finalize_writes_openai_files_once(settings: Settings, db: Database, store: ObjectStore) -> None:
    data = "\n".join([line("ok1"), line("ok2"), line("bad-at-worker"), line("dies"), "{x"]).encode()
    batch_id = make_batch(db, store, data)
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    by_cid = {j.custom_id: j for j in batch_jobs(db, batch_id)}
    _finish(db, store, by_cid["ok1"], "one")
    with db.session() as session:
        assert jobs.claim(session, by_cid["bad-at-worker"].id, "w", 60)
        assert jobs.fail(session, by_cid["bad-at-worker"].id, "w", "invalid_input", "image count mismatch")
        session.get(Job, by_cid["dies"].id).max_attempts = 1  # type: ignore[union-attr]
    with db.session() as session:
        assert jobs.claim(session, by_cid["dies"].id, "w", 60)
        assert jobs.release(session, by_cid["dies"].id, "w", "worker_error", "boom") == "dead"
        assert batches.ready_after_job(session, by_cid["dies"].id) is None  # ok2 still queued
    assert finalize_batch(batch_id, db, store) == "in_progress"
    _finish(db, store, by_cid["ok2"], "two")
    with db.session() as session:
        assert batches.ready_after_job(session, by_cid["ok2"].id) == batch_id
    assert batch_id in due_batches(db)

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(finalize_batch(batch_id, db, store)))
               for _ in range(3)]  # racing finalizers: one wins, the others roll back their file rows
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "completed" in results and set(results) <= {"in_progress", "finalizing", "completed"}
    batch = get_batch(db, batch_id)
    with db.session() as session:
        view = batches.batch_view(session, batch)
        n_files = session.scalar(select(func.count()).select_from(FileRecord)
                                 .where(FileRecord.filename.like(f"{batch_id}_%")))
    assert n_files == 2 and batch_id not in due_batches(db)
    assert view["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert view["usage"]["input_tokens"] == 10 and view["usage"]["output_tokens"] == 4
    assert view["completed_at"] >= view["finalizing_at"] >= view["in_progress_at"] >= view["created_at"]

    output = _read_jsonl(store, db, batch.output_file_id or "")
    assert {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in output} == {
        "ok1": "one", "ok2": "two"}
    assert all(o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
               for o in output)
    errors = {(e["custom_id"], e["error"]["code"]): e for e in _read_jsonl(store, db, batch.error_file_id or "")}
    assert set(errors) == {(None, "invalid_json"), ("bad-at-worker", "invalid_input"), ("dies", "worker_error")}
    assert errors[(None, "invalid_json")]["response"] is None
    assert errors[("bad-at-worker", "invalid_input")]["response"]["status_code"] == 400
    assert errors[("dies", "worker_error")]["response"]["status_code"] == 500
    assert finalize_batch(batch_id, db, store) == "completed"  # again: nothing changes


def test_finalize_builds_lines_from_the_rows(settings: Settings, db: Database, store: ObjectStore,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """No result object is read back: every line comes from its row. Where the object disagrees with the row
    (a worker that lost its lease stored its own sampled answer after the new holder finished), the output
    says what the row, the truth, says."""
    data = "\n".join([line("a"), line("b"), line("c")]).encode()
    batch_id = make_batch(db, store, data)
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    by_cid = {j.custom_id: j for j in batch_jobs(db, batch_id)}
    for cid, job in by_cid.items():
        _finish(db, store, job, f"answer {cid}\x00")
    stale = by_cid["b"]
    stale_body = chat_completion(stale.id, stale.model, 0, "stale", "length", 5, 9)
    store.put(result_key(stale.id, stale.tenant), json.dumps(stale_body).encode())
    store.delete(result_key(by_cid["c"].id, by_cid["c"].tenant))
    reads: list[str] = []
    original_get = store.get
    monkeypatch.setattr(store, "get", lambda key: reads.append(key) or original_get(key))  # type: ignore[func-returns-value]
    assert finalize_batch(batch_id, db, store) == "completed"
    assert [key for key in reads if "results/" in key] == []
    monkeypatch.undo()
    batch = get_batch(db, batch_id)
    output = {o["custom_id"]: o["response"]["body"] for o in _read_jsonl(store, db, batch.output_file_id or "")}
    assert {cid: body["choices"][0]["message"]["content"] for cid, body in output.items()} == {
        "a": "answer a\x00", "b": "answer b\x00", "c": "answer c\x00"}
    job = by_cid["a"]
    assert output["a"] == chat_completion(job.id, job.model, int(job.created_at.timestamp()), "answer a\x00", "stop",
                                          5, 2)


def test_cancel_during_ingestion(settings: Settings, db: Database, store: ObjectStore) -> None:
    batch_id = make_batch(db, store, ("\n".join(line(f"c{i}") for i in range(7)) + "\n{x\n").encode())

    def cancel_after_first_chunk(calls: int) -> None:
        if calls == 1:
            with db.session() as session:
                assert batches.request_cancel(session, batch_id)

    deps = IngestDeps(settings, db, store, Recorder(hook=cancel_after_first_chunk))
    assert ingest_batch(batch_id, deps) == "cancelling"
    created = batch_jobs(db, batch_id)
    assert len(created) == 3  # the chunk being written when the cancel came was rolled back
    _finish(db, store, created[0], "done before the cancel")
    assert finalize_batch(batch_id, db, store) == "cancelling"  # two jobs still queued
    assert cancel_batch_jobs(batch_id, db) == 2
    assert finalize_batch(batch_id, db, store) == "cancelled"
    batch = get_batch(db, batch_id)
    assert batch.cancelled_at is not None and batch.cancelling_at is not None
    assert [o["custom_id"] for o in _read_jsonl(store, db, batch.output_file_id or "")] == [created[0].custom_id]
    errors = _read_jsonl(store, db, batch.error_file_id or "")
    assert sorted(e["error"]["code"] for e in errors) == ["batch_cancelled", "batch_cancelled"]
    with db.session() as session:
        assert batches.request_counts(session, batch) == {"total": 3, "completed": 1, "failed": 0}


def _expire_now(db: Database, batch_id: str) -> None:
    with db.session() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        batch.expires_at = batch.created_at - timedelta(seconds=1)


def test_expiry_keeps_finished_results(settings: Settings, db: Database, store: ObjectStore) -> None:
    batch_id = make_batch(db, store, "\n".join(line(f"x{i}") for i in range(5)).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    created = batch_jobs(db, batch_id)
    _finish(db, store, created[0], "in time")
    with db.session() as session:
        assert jobs.claim(session, created[1].id, "w", 60)
    not_yet = make_batch(db, store, line("y").encode())  # validating, its window not over
    late = make_batch(db, store, line("z").encode())  # never ingested
    _expire_now(db, batch_id)
    _expire_now(db, late)
    assert set(expire_due(db)) == {batch_id, late}
    assert expire_batch(batch_id, db) == 4  # three queued and the running one
    with db.session() as session:  # the worker still running it is refused
        assert not jobs.finish(session, created[1].id, "w", jobs.JobResult("k", "late", "stop", 1, 1))
    assert finalize_batch(batch_id, db, store) == "expired"
    assert finalize_batch(late, db, store) == "expired"
    assert ingest_batch(late, IngestDeps(settings, db, store, Recorder())) == "expired"
    assert get_batch(db, not_yet).status == "validating" and expire_due(db) == []
    batch = get_batch(db, batch_id)
    assert batch.expired_at is not None and batch.completed_at is None
    assert [o["custom_id"] for o in _read_jsonl(store, db, batch.output_file_id or "")] == [created[0].custom_id]
    errors = _read_jsonl(store, db, batch.error_file_id or "")
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 4
    with db.session() as session:
        assert batches.batch_view(session, batch)["request_counts"] == {"total": 5, "completed": 1, "failed": 0}


def test_the_sweep_that_expires_a_batch_sends_its_finalize(settings: Settings, db: Database, store: ObjectStore
                                                           ) -> None:
    """Expired while no job of it runs (the last running one ended a moment before, its batch still open), no
    job's end is left to send finalize_batch: the sweep that cancelled the rest sends it."""
    from common.broker.queue import TASK_FINALIZE_BATCH, TASK_SWEEP_BATCHES, make_celery
    from tests.api.test_jobs_api import _messages
    from worker.tasks import register_tasks

    batch_id = make_batch(db, store, "\n".join(line(f"s{i}") for i in range(3)).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    _finish(db, store, batch_jobs(db, batch_id)[0], "in time")
    _expire_now(db, batch_id)
    # A broker db of its own: a consumer of the session's queues (another test's worker) cannot take the message.
    with held_redis_db() as broker_url:
        local = settings.model_copy(update={"broker_url": broker_url})
        app = make_celery(local)
        register_tasks(app)
        swept = app.tasks[TASK_SWEEP_BATCHES].apply()  # run here, as the ingest worker runs what beat sends
        assert swept.successful(), swept.traceback
        assert get_batch(db, batch_id).status == "finalizing"
        sent = [m for m in _messages(local, "ingest") if m["headers"]["argsrepr"] == repr([batch_id])]
    assert [m["headers"]["task"] for m in sent] == [TASK_FINALIZE_BATCH]
    assert finalize_batch(batch_id, db, store) == "expired"


def test_the_sweep_resends_an_ingestion_the_broker_lost(settings: Settings, db: Database, store: ObjectStore
                                                        ) -> None:
    """A batch still validating with no ingest_batch message queued or taken (Redis restarted empty) gets one
    again; one whose message is queued, or taken by a worker and not yet acked, does not."""
    import redis

    from common.broker.queue import TASK_INGEST_BATCH, TASK_SWEEP_BATCHES, make_celery, send_ingest_batch
    from tests.api.test_jobs_api import _messages
    from worker.tasks import register_tasks

    lost, queued, taken = (make_batch(db, store, line(f"{name}0").encode()) for name in ("lost", "queued", "taken"))
    with held_redis_db() as broker_url:
        local = settings.model_copy(update={"broker_url": broker_url, "republish_grace_seconds": 0.0})
        app = make_celery(local)
        register_tasks(app)
        for batch_id in (queued, taken):
            send_ingest_batch(app, local, batch_id)
        client = redis.Redis.from_url(broker_url)
        key = next(k for k in client.keys("ingest*") if client.type(k) == b"list")
        for raw in client.lrange(key, 0, -1):  # a worker took `taken`'s message: kombu keeps it in `unacked`
            assert isinstance(raw, bytes)
            if repr([taken]) in raw.decode():
                client.lrem(key, 1, raw)  # type: ignore[arg-type]  # redis-py takes bytes too
                client.hset("unacked", "tag-1", b"[" + raw + b', "", "ingest"]')
        swept = app.tasks[TASK_SWEEP_BATCHES].apply()
        assert swept.successful(), swept.traceback
        sent = [(m["headers"]["task"], m["headers"]["argsrepr"]) for m in _messages(local, "ingest")]
        client.close()
    assert [t for t, args in sent if args == repr([lost])] == [TASK_INGEST_BATCH]
    assert [t for t, args in sent if args == repr([queued])] == [TASK_INGEST_BATCH]  # the one sent, only
    assert not [t for t, args in sent if args == repr([taken])]


def test_a_batch_whose_jobs_all_ended_completes_past_its_window(settings: Settings, db: Database,
                                                                  store: ObjectStore) -> None:
    """The last job ended before the sweep saw the window close: the batch finishes `completed`, not
    `expired` with nothing expired in it (the finalize of its last job may still be on its way)."""
    batch_id = make_batch(db, store, "\n".join(line(f"d{i}") for i in range(3)).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    created = batch_jobs(db, batch_id)
    for job in created[:2]:
        _finish(db, store, job, "in time")
    _expire_now(db, batch_id)
    with db.session() as session:
        assert batches.due_for_expiry(session) == [batch_id]  # one job still queued: late
    _finish(db, store, created[2], "in time too")
    assert expire_due(db) == []
    with db.session() as session:
        assert not batches.expire(session, batch_id)
    assert finalize_batch(batch_id, db, store) == "completed"
    batch = get_batch(db, batch_id)
    assert batch.expired_at is None and batch.completed_at is not None and batch.error_file_id is None
    assert len(_read_jsonl(store, db, batch.output_file_id or "")) == 3


def test_a_batch_may_name_only_its_own_tenants_images(settings: Settings, db: Database, store: ObjectStore
                                                    ) -> None:
    """Another tenant's image id is unknown to a batch line, as one never uploaded; the same bytes sent as a
    data: URL are the batch tenant's from then on."""
    secret = png_bytes((7, 77, 177), (6, 5))
    with db.session() as session:
        theirs = store_image(session, store, secret, settings, "someone-else").id
    by_id = json.dumps({"custom_id": "by-id", "body": {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"img_{theirs}"}}, {"type": "text", "text": "hi"}]}]}})
    batch_id = make_batch(db, store, "\n".join([by_id, line("by-bytes", image=secret)]).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    assert line_errors(db, batch_id) == [(1, "by-id", "unknown_image")]
    [job] = batch_jobs(db, batch_id)
    assert job.custom_id == "by-bytes" and job.request["messages"][0]["content"][0]["image_id"] == theirs
    with db.session() as session:
        assert owned_image(session, "default", theirs) is not None


def test_ingest_and_finalize_on_sqlite_and_a_local_folder(tmp_path: Path) -> None:
    local = Settings(data_dir=tmp_path, model=f"/models/{MODEL}", ingest_chunk_rows=2)
    upgrade(local.database_url)
    db, store = get_database(local.database_url), make_store(local)
    data = "\n".join([line("a", image=png_bytes()), line("b"), line("a"), line("c", image=png_bytes())]).encode()
    batch_id = make_batch(db, store, data)
    assert ingest_batch(batch_id, IngestDeps(local, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == [(3, "a", "duplicate_custom_id")]  # found by ON CONFLICT on SQLite too
    for job in batch_jobs(db, batch_id):
        _finish(db, store, job, f"answer {job.custom_id}")
    assert finalize_batch(batch_id, db, store) == "completed"
    batch = get_batch(db, batch_id)
    output = _read_jsonl(store, db, batch.output_file_id or "")
    assert sorted(o["custom_id"] for o in output) == ["a", "b", "c"]
    assert (tmp_path / "objects" / "tenants" / "default" / "batches" / batch_id / "output.jsonl").is_file()
    # A batch none of whose lines can run fails at ingestion; its error file lists them all, at once: the
    # finalizer wrote it in sessions of its own while its first still held SQLite's write lock, and waited out
    # the busy timeout on every attempt.
    no_custom_id = json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}})
    refused = make_batch(db, store, b"not json\n" + line("x", model="another-model").encode() + b"\n"
                         + no_custom_id.encode())
    assert ingest_batch(refused, IngestDeps(local, db, store, Recorder())) == "failed"
    started = time.monotonic()
    assert finalize_batch(refused, db, store) == "failed"
    assert time.monotonic() - started < 5
    errors = _read_jsonl(store, db, get_batch(db, refused).error_file_id or "")
    assert [e["custom_id"] for e in errors] == [None, "x", None]
    # The batch's errors name the field at fault where the line's check knew it, as OpenAI's do.
    listed = get_batch(db, refused).errors or []
    assert [(e["code"], e["param"]) for e in listed] == [("invalid_json", None), ("model_not_found", None),
                                                         ("missing_custom_id", "custom_id")]
    db.dispose()


def test_first_chunks_are_small_and_double(settings: Settings, db: Database, store: ObjectStore) -> None:
    """Workers get a batch's first jobs after `ingest_first_chunk_rows` lines, not a whole chunk; chunks then
    double up to `ingest_chunk_rows`, and a crash between them still resumes with every job sent once."""
    growing = settings.model_copy(update={"ingest_first_chunk_rows": 2, "ingest_chunk_rows": 8})
    data = ("\n".join(line(f"g{i}") for i in range(20)) + "\n").encode()
    batch_id = make_batch(db, store, data)
    progress: list[int] = []
    sent = Recorder(hook=lambda calls: progress.append(get_batch(db, batch_id).ingested_lines))
    assert ingest_batch(batch_id, IngestDeps(growing, db, store, sent)) == "in_progress"
    assert progress == [2, 6, 14, 20]  # chunks of 2, 4, 8, then the 6 left
    assert sorted(sent.sent) == sorted(j.id for j in batch_jobs(db, batch_id)) and len(sent.sent) == 20

    batch_id = make_batch(db, store, data)
    first = Recorder(fail_on_call=3)
    with pytest.raises(ConnectionError):  # the third chunk (8 lines) committed, then its dispatch failed
        ingest_batch(batch_id, IngestDeps(growing, db, store, first))
    assert get_batch(db, batch_id).ingested_lines == 14 and len(first.sent) == 6
    again = Recorder()
    assert ingest_batch(batch_id, IngestDeps(growing, db, store, again)) == "in_progress"
    created = batch_jobs(db, batch_id)
    assert sorted(j.custom_id or "" for j in created) == sorted(f"g{i}" for i in range(20))
    assert sorted(first.sent + again.sent) == sorted(j.id for j in created)
    assert get_batch(db, batch_id).total_requests == 20


def test_lines_over_the_models_context_or_the_caps_are_refused(settings: Settings, db: Database,
                                                               store: ObjectStore, tmp_path: Path) -> None:
    """The served model's files are readable here (its config and tokenizer: the demo model's, a 256-token
    context): a line whose prompt cannot fit is refused at ingestion, not failed by a worker."""
    from worker.demo import DEMO_MODEL_DIR

    folder = tmp_path / MODEL  # the served name stays the folder's: the batch's model
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_MODEL_DIR / name).read_bytes())
    served = settings.model_copy(update={"model": str(folder), "max_job_messages": 50})
    many = json.dumps({"custom_id": "many", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 51}})
    data = "\n".join([line("short", "What colour is the star?"), line("long", "the star " * 400), many]) + "\n"
    batch_id = make_batch(db, store, data.encode())
    assert ingest_batch(batch_id, IngestDeps(served, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == [(2, "long", "context_length_exceeded"), (3, "many", "too_many_messages")]
    assert [j.custom_id for j in batch_jobs(db, batch_id)] == ["short"]
    with db.session() as session:
        errors = {e.custom_id: e for e in session.scalars(select(BatchLineError)
                                                          .where(BatchLineError.batch_id == batch_id))}
    assert errors["long"].param == "messages" and "takes at most 255 prompt tokens" in errors["long"].message


def _image_statements(db: Database) -> tuple[list[str], Callable[[], None]]:
    """The SQL statements about images and their owners sent from now on, and how to stop recording them."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if re.search(r"\b(images|image_owners)\b", statement):
            sent.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    return sent, lambda: event.remove(db.engine, "before_cursor_execute", record)


def test_a_chunks_images_cost_a_few_round_trips_and_get_the_answers_they_got_alone(
        settings: Settings, db: Database, store: ObjectStore) -> None:
    """A chunk's data: URL images are looked up and written a window of lines at a time
    (worker/batches/image_window.py): the statements about images do not grow with their number, and every
    line gets what store_image gave it alone, refusals included."""
    one_chunk = settings.model_copy(update={"ingest_first_chunk_rows": 200, "ingest_chunk_rows": 200,
                                            "max_image_bytes": 4096})
    seed = uuid.uuid4().bytes  # images no other test stored
    pictures = [png_bytes((seed[0], seed[1], i), (3 + i % 10, 2 + i // 10)) for i in range(100)]
    mine, theirs = png_bytes((seed[2], 1, 1)), png_bytes((seed[2], 2, 2))
    junk = png_bytes((seed[2], 3, 3))[:40]  # a truncated PNG
    noise = random.Random(seed).randbytes(48 * 48 * 3)
    big = io.BytesIO()
    Image.frombytes("RGB", (48, 48), noise).save(big, format="PNG")  # over one_chunk's max_image_bytes
    earlier = make_batch(db, store, (line("mine", image=mine) + "\n").encode())
    assert ingest_batch(earlier, IngestDeps(one_chunk, db, store, Recorder())) == "in_progress"
    [mine_ref] = image_refs(batch_jobs(db, earlier)[0].request)
    with db.session() as session:
        store_image(session, store, theirs, one_chunk, "someone-else")  # an object of its own, no pack
    lines = [line(f"p{i}", image=picture) for i, picture in enumerate(pictures)]
    extra = {5: line("junk", image=junk), 10: line("mine", image=mine), 20: line("theirs", image=theirs),
             30: line("big", image=big.getvalue()), 40: line("text"), 50: line("again-3", image=pictures[3]),
             80: line("again-70", image=pictures[70]), 90: line("junk-again", image=junk),
             95: line("bad-base64", image=b"x").replace(data_url(b"x"), "data:image/png;base64,@@")}
    for at in sorted(extra, reverse=True):
        lines.insert(at, extra[at])
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    sent, stop = _image_statements(db)
    try:
        assert ingest_batch(batch_id, IngestDeps(one_chunk, db, store, Recorder())) == "in_progress"
    finally:
        stop()
    # 109 lines, 101 new images: two windows, each one SELECT and one INSERT.
    assert len(lines) == 109 and len(sent) <= 4, sent
    errors = line_errors(db, batch_id)
    assert [(custom_id, code) for _, custom_id, code in errors] == [
        ("junk", "invalid_image"), ("big", "image_too_large"), ("junk-again", "invalid_image"),
        ("bad-base64", "invalid_image")]
    with db.session() as session:
        messages = {e.custom_id: e.message for e in session.scalars(
            select(BatchLineError).where(BatchLineError.batch_id == batch_id))}
    assert messages["big"].endswith(f"image is {len(big.getvalue())} bytes; the limit is 4096")
    assert "truncated or corrupt" in messages["junk"] and "invalid base64" in messages["bad-base64"]
    created = {job.custom_id: job for job in batch_jobs(db, batch_id)}
    refs = {custom_id: image_refs(job.request) for custom_id, job in created.items()}
    reader = ImageReader(store)
    for i, picture in enumerate(pictures):
        [ref] = refs[f"p{i}"]
        assert ref.pack is not None and reader.read(ref) == picture
    assert refs["again-3"] == refs["p3"] and refs["again-70"] == refs["p70"]
    assert refs["mine"] == [mine_ref]  # the tenant's own: its row, where an earlier batch packed it
    # Only another tenant's: stored again, into this batch's pack, and answered from this copy.
    [their_ref] = refs["theirs"]
    assert their_ref.pack is not None and reader.read(their_ref) == theirs
    assert refs["text"] == []
    with db.session() as session:
        owned = owned_images(session, "default", [hashlib.sha256(p).hexdigest() for p in [*pictures, theirs]])
    assert len(owned) == 101
