"""worker/jobs/chunk_runner.py: the rows of one run_job message claimed together, fed to the model from the message's
thread and finished as each ends; on SQLite and a local folder, with a model that stands in for the engine."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.domain.models import Job, JobStatus
from common.images.pack import ImagePack
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store, result_key
from tests.api.test_jobs_api import png_bytes
from worker.inference.generation import Aborted, GenerationRequest, GenerationResult, InputError, SamplingParams
from worker.jobs.chunk_runner import ChunkRunner
from worker.jobs.group import JobGroupRunner
from worker.jobs.image_reader import ImageRef
from worker.jobs.leases import LeaseKeeper
from worker.jobs.pipeline import Ending, JobPipeline, Outcome

MODEL = "stand-in"


def _request(text: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            "sampling": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": None, "seed": None,
                         "stop": []}}


class _HeldModel:
    """Answers each prompt with its own text reversed, once `release(text)` (or release_all) says so; a prompt
    "bad input" is refused at prepare and "crash" fails in generation."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.prepare_threads: set[str] = set()
        self.image_sizes: list[tuple[int, int]] = []
        self._futures: dict[str, tuple[str, Future[GenerationResult]]] = {}
        self._lock = threading.Lock()

    def prepare(self, req: GenerationRequest) -> GenerationRequest:
        self.prepare_threads.add(threading.current_thread().name)
        self.image_sizes += [image.size for image in req.images]
        if req.messages[0]["content"][0]["text"] == "bad input":
            raise InputError("the prompt is refused")
        return req

    def submit(self, req: GenerationRequest) -> Future[GenerationResult]:
        text = req.messages[0]["content"][0]["text"]
        future: Future[GenerationResult] = Future()
        with self._lock:
            self._futures[text] = (req.request_id, future)
        if not self.hold:
            self.release(text)
        return future

    def release(self, text: str) -> None:
        with self._lock:
            request_id, future = self._futures.pop(text)
        if text == "crash":
            future.set_exception(RuntimeError("the engine fell over"))
        else:
            future.set_result(GenerationResult(request_id, text[::-1], [1], "stop", 3, 1))

    def release_all(self) -> None:
        with self._lock:
            texts = list(self._futures)
        for text in texts:
            self.release(text)

    def abort(self, request_id: str) -> None:
        """As the engine does: a request it holds fails with Aborted; one it does not know of is ignored."""
        with self._lock:
            held = [text for text, (rid, _) in self._futures.items() if rid == request_id]
            futures = [self._futures.pop(text)[1] for text in held]
        for future in futures:
            future.set_exception(Aborted(f"request {request_id} was aborted"))

    def close(self, timeout: float = 10.0) -> None:
        pass


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[Settings, Database, ObjectStore]]:
    settings = Settings(data_dir=tmp_path, model=f"/models/{MODEL}", persist_retry_seconds=1, retry_backoff_seconds=0)
    upgrade(settings.database_url)
    yield settings, get_database(settings.database_url), make_store(settings)


def _runner(local: tuple[Settings, Database, ObjectStore], model: _HeldModel) -> ChunkRunner:
    settings, db, store = local
    # An hour between beats: a lost job is found only when a test asks (check), as a cancel's broadcast does.
    leases = LeaseKeeper(db, "worker-1", settings.lease_seconds, 3600, on_lost=model.abort)
    pipeline = JobPipeline(settings, db, store, model, leases, "worker-1")
    return ChunkRunner(pipeline, JobGroupRunner(pipeline, 8))


def _close(runner: ChunkRunner) -> None:
    runner.pool.close()
    runner.pipeline.close()
    runner.pipeline.leases.close()


def _rows(db: Database, texts: list[str], batch_id: str | None = "batch_x") -> list[str]:
    with db.session() as session:
        return [jobs.create_job(session, model=MODEL, request=_request(text), tenant="acme", batch_id=batch_id).id
                for text in texts]


def _statuses(db: Database, job_ids: list[str]) -> dict[str, tuple[str, str | None, str | None]]:
    with db.session() as session:
        rows = {job.id: (job.status, job.result_text, job.result_key)
                for job in session.query(Job).filter(Job.id.in_(job_ids))}
    return {job_id: rows[job_id] for job_id in job_ids}


def test_a_chunk_ends_every_kind_of_row_as_its_own_message_would(local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, store = local
    model = _HeldModel(hold=False)
    runner = _runner(local, model)
    rows = _rows(db, ["one", "two", "bad input", "crash", "three"])
    [single] = _rows(db, ["alone"], batch_id=None)
    [held] = _rows(db, ["held elsewhere"])
    with db.session() as session:
        assert jobs.claim(session, held, "worker-2", 600) is not None
    ended: list[tuple[str, Outcome | Exception]] = []
    try:
        outcomes = runner.run([*rows, single, held, rows[0]], on_job_done=lambda j, o: ended.append((j, o)))
    finally:
        _close(runner)
    one, two, bad, crash, three = rows
    assert [o.status if isinstance(o, Outcome) else o for o in outcomes] == [
        "succeeded", "succeeded", "failed", "queued", "succeeded", "succeeded", "skipped", "skipped"]
    assert isinstance(outcomes[3], Outcome) and outcomes[3].retry  # released: the message runs it again
    assert all(isinstance(o, Outcome) and o.tenant == "acme" and o.model == MODEL for o in outcomes[:6])
    status = _statuses(db, [*rows, single, held])
    assert status[one] == ("succeeded", "eno", None)  # a batch row's result is its row
    assert status[two][:2] == ("succeeded", "owt") and status[three][:2] == ("succeeded", "eerht")
    assert status[bad][0] == "failed" and status[crash][0] == "queued"
    assert status[single] == ("succeeded", "enola", result_key(single, "acme"))  # a single job keeps its object
    assert store.get(result_key(single, "acme"))
    assert status[held][0] == "running"  # another worker's: untouched
    # Each row is reported once as it ends, the duplicate and the skipped one included.
    assert sorted(job_id for job_id, _ in ended) == sorted([*rows, single, held])
    # Batch rows were prepared on the message's thread; only the single job went to a job thread.
    assert threading.current_thread().name in model.prepare_threads
    assert {name for name in model.prepare_threads if name.startswith("vlmq-job")}
    assert not runner.pipeline.leases.held()


def test_rows_are_finished_as_they_end_not_at_the_chunks_end(local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, _ = local
    model = _HeldModel(hold=True)
    runner = _runner(local, model)
    rows = _rows(db, [f"row {i}" for i in range(6)])
    result: list[list[Outcome | Exception]] = []
    thread = threading.Thread(target=lambda: result.append(runner.run(rows)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(model._futures) < len(rows):  # every row submitted, none answered
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert {s for s, *_ in _statuses(db, rows).values()} == {"running"}
        model.release("row 2")
        while _statuses(db, rows)[rows[2]][0] != "succeeded":
            assert time.monotonic() < deadline, "the row that ended was not finished while the others ran"
            time.sleep(0.01)
        assert [s for s, *_ in _statuses(db, rows).values()].count("running") == 5
        assert thread.is_alive()
        model.release_all()
        thread.join(30)
    finally:
        model.release_all()
        thread.join(30)
        _close(runner)
    assert [o.status for o in result[0] if isinstance(o, Outcome)] == ["succeeded"] * 6
    # One group claimed the chunk; finishes were grouped too, never one transaction a row.
    assert runner.pipeline.writer.num_transactions < len(rows) + 1


def test_a_last_try_in_a_chunk_runs_alone_after_the_chunks_other_rows(
        local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, _ = local
    model = _HeldModel(hold=False)
    runner = _runner(local, model)
    rows = _rows(db, ["first", "last try", "third"])
    with db.session() as session:
        session.execute(update(Job).where(Job.id == rows[1]).values(attempts=Job.max_attempts - 1))
    try:
        outcomes = runner.run(rows)
    finally:
        _close(runner)
    assert [o.status for o in outcomes if isinstance(o, Outcome)] == ["succeeded"] * 3
    assert _statuses(db, rows)[rows[1]][:2] == ("succeeded", "yrt tsal")


def test_a_chunk_whose_claim_cannot_reach_sql_hands_every_row_back(
        local: tuple[Settings, Database, ObjectStore], monkeypatch: pytest.MonkeyPatch) -> None:
    _, db, _ = local
    runner = _runner(local, _HeldModel(hold=False))
    rows = _rows(db, ["a", "b"])

    def unreachable(job_ids: list[str]) -> dict[str, object]:
        raise ConnectionError("SQL is unreachable")

    monkeypatch.setattr(runner.pipeline.writer, "claim_all", unreachable)
    try:
        outcomes = runner.run(rows)
    finally:
        _close(runner)
    assert all(isinstance(o, ConnectionError) for o in outcomes)
    assert {s for s, *_ in _statuses(db, rows).values()} == {JobStatus.QUEUED}


def _image_request(text: str, image: dict[str, object]) -> dict[str, object]:
    request = _request(text)
    request["messages"][0]["content"].append(image)  # type: ignore[index]
    return request


def test_a_chunks_packed_images_are_read_with_one_request(local: tuple[Settings, Database, ObjectStore],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _, db, store = local
    pictures = [png_bytes((40 * i, 10, 10), (8 + i, 6)) for i in range(3)]
    pack = ImagePack(store, 1 << 20)
    parts = [{"type": "image", "image_id": hashlib.sha256(p).hexdigest(), **pack.add(p).as_part_fields()}
             for p in pictures]
    pack.flush()
    ranges: list[tuple[str, int, int]] = []
    read_range = store.get_range
    monkeypatch.setattr(store, "get_range", lambda key, start, size: ranges.append((key, start, size))  # type: ignore[func-returns-value]
                        or read_range(key, start, size))
    model = _HeldModel(hold=False)
    runner = _runner(local, model)
    with db.session() as session:
        rows = [jobs.create_job(session, model=MODEL, request=_image_request(f"look {i}", part), tenant="acme",
                                batch_id="batch_x").id for i, part in enumerate(parts)]
    try:
        outcomes = runner.run(rows)
    finally:
        _close(runner)
    assert [o.status for o in outcomes if isinstance(o, Outcome)] == [JobStatus.SUCCEEDED] * 3
    assert ranges == [(parts[0]["pack"], 0, sum(len(p) for p in pictures))]  # one request for the chunk
    assert [s[1] for s in _statuses(db, rows).values()] == ["0 kool", "1 kool", "2 kool"]
    assert sorted(model.image_sizes) == [(8, 6), (9, 6), (10, 6)]  # each row decoded its own picture
    assert model.prepare_threads == {threading.current_thread().name}  # on the message's thread, no job thread


def test_a_row_whose_image_is_not_where_it_says_fails_alone(local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, store = local
    good, other = png_bytes((1, 2, 3), (5, 5)), png_bytes((3, 2, 1), (6, 6))
    pack = ImagePack(store, 1 << 20)
    good_at, other_at = pack.add(good), pack.add(other)
    pack.flush()
    wrong = {"type": "image", "image_id": hashlib.sha256(good).hexdigest(), **other_at.as_part_fields()}
    right = {"type": "image", "image_id": hashlib.sha256(good).hexdigest(), **good_at.as_part_fields()}
    model = _HeldModel(hold=False)
    runner = _runner(local, model)
    with db.session() as session:
        rows = [jobs.create_job(session, model=MODEL, request=_image_request(text, part), tenant="acme",
                                batch_id="batch_x").id for text, part in (("fine", right), ("misplaced", wrong))]
    try:
        runner.run(rows)
    finally:
        _close(runner)
    with db.session() as session:
        fine, misplaced = (session.get(Job, job_id) for job_id in rows)
        assert fine is not None and fine.status == JobStatus.SUCCEEDED and fine.result_text == "enif"
        assert misplaced is not None and misplaced.status == JobStatus.FAILED
        assert misplaced.error_code == "image_missing"


class _RecordingPreparePool:
    """Stands in for worker/jobs/prepare_pool.py: records what each image row was handed, on which thread."""

    def __init__(self) -> None:
        self.handed: dict[str, tuple[int, str]] = {}

    def prepare(self, job_id: str, request: dict[str, Any], priority: int, tenant: str,
                fetched: dict[ImageRef, bytes] | None = None) -> GenerationRequest:
        self.handed[job_id] = (len(fetched or {}), threading.current_thread().name)
        text = request["messages"][0]["content"][0]["text"]
        return GenerationRequest(request_id=job_id, messages=[{"role": "user", "content": [
            {"type": "text", "text": text}]}], images=[], sampling=SamplingParams(max_tokens=4), priority=priority)

    def close(self) -> None:
        pass


def test_with_a_prepare_pool_image_rows_wait_on_job_threads_with_their_images(
        local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, store = local
    pictures = [png_bytes((9, 9 * i, 90), (6, 6)) for i in range(2)]
    pack = ImagePack(store, 1 << 20)
    parts = [{"type": "image", "image_id": hashlib.sha256(p).hexdigest(), **pack.add(p).as_part_fields()}
             for p in pictures]
    pack.flush()
    runner = _runner(local, _HeldModel(hold=False))
    pool = _RecordingPreparePool()
    runner.pipeline.prepare_pool = pool  # type: ignore[assignment]
    with db.session() as session:
        rows = [jobs.create_job(session, model=MODEL, request=_image_request(f"pic {i}", part), tenant="acme",
                                batch_id="batch_x").id for i, part in enumerate(parts)]
        [text_row] = [jobs.create_job(session, model=MODEL, request=_request("words"), tenant="acme",
                                      batch_id="batch_x").id]
    try:
        outcomes = runner.run([*rows, text_row])
    finally:
        _close(runner)
    assert [o.status for o in outcomes if isinstance(o, Outcome)] == [JobStatus.SUCCEEDED] * 3
    # Whichever path a row took, the one that ended last let go of the batch's last row here (after_job.py).
    assert sum(o.batch_drained for o in outcomes if isinstance(o, Outcome)) == 1
    # Each image row got its own image, read with the chunk's, and waited on a job thread; the text row did not
    # go to the pool at all.
    assert set(pool.handed) == set(rows)
    assert all(count == 1 and name.startswith("vlmq-job") for count, name in pool.handed.values())


def test_rows_cancelled_in_the_model_end_lost_never_failed_nor_run_again(
        local: tuple[Settings, Database, ObjectStore], caplog: pytest.LogCaptureFixture) -> None:
    """A batch's cancel reaches rows a chunk has handed to the model: each is aborted there and ends as lost,
    with no SQL of its own (no release that would be refused), no error, nothing to run again; a row that
    finished before keeps its result."""
    _, db, _ = local
    model = _HeldModel(hold=True)
    runner = _runner(local, model)
    rows = _rows(db, ["kept", "gone 1", "gone 2"])
    [single] = _rows(db, ["single gone"], batch_id=None)  # a single job, waiting on a job thread
    result: list[list[Outcome | Exception]] = []
    thread = threading.Thread(target=lambda: result.append(runner.run([*rows, single])))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(model._futures) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        model.release("kept")
        while _statuses(db, rows)[rows[0]][0] != JobStatus.SUCCEEDED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with db.session() as session:
            assert jobs.cancel_many(session, [*rows, single]) == 3
        caplog.clear()
        assert runner.pipeline.leases.check() == 3  # what the cancel's broadcast has the keeper do
        thread.join(30)
        assert not thread.is_alive()
    finally:
        model.release_all()
        thread.join(30)
        _close(runner)
    assert [o.status if isinstance(o, Outcome) else o for o in result[0]] == [
        JobStatus.SUCCEEDED, Ending.LOST, Ending.LOST, Ending.LOST]
    assert not any(o.retry for o in result[0] if isinstance(o, Outcome))
    status = _statuses(db, [*rows, single])
    assert status[rows[0]] == (JobStatus.SUCCEEDED, "tpek", None)
    assert all(status[j] == (JobStatus.CANCELLED, None, None) for j in [*rows[1:], single])
    with db.session() as session:
        assert {job.error_code for job in session.query(Job).filter(Job.id.in_([*rows, single]))} == {None}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_row_lost_before_its_turn_is_not_prepared_and_one_lost_while_prepared_is_aborted(
        local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, _ = local
    model = _HeldModel(hold=True)
    runner = _runner(local, model)
    pipeline = runner.pipeline
    early, late = _rows(db, ["early", "late"])
    try:
        with db.session() as session:
            claims = {job.id: ClaimedJob.of(job) for job in (jobs.claim(session, j, "worker-1", 600)
                                                             for j in (early, late)) if job is not None}
            jobs.cancel_many(session, [early])
        pipeline.leases.add(early, "batch_x")
        pipeline.leases.add(late, "batch_x")
        assert pipeline.leases.check() == 1  # early: found cancelled before the pipeline reached it
        assert pipeline.run_held(claims[early]).status == Ending.LOST
        assert model.prepare_threads == set()  # never prepared
        prepared = pipeline.prepare(claims[late], {})
        pipeline.leases.discard(late)  # lost while it was prepared: the keeper's abort found nothing to stop
        future = pipeline.submit(claims[late], prepared)
        with pytest.raises(Aborted):  # so the submit aborts it itself
            future.result(timeout=5)
    finally:
        _close(runner)
