"""worker/jobs/pipeline.py: one job's path through a worker, on SQLite and a local folder, with a model that
stands in for the engine (so a test can act while the job is "generating")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from common.domain import jobs
from common.domain.models import Job
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, image_key, make_store, result_key
from tests.api.test_jobs_api import png_bytes
from worker.inference.generation import GenerationRequest, GenerationResult
from worker.jobs.leases import LeaseKeeper
from worker.jobs.pipeline import JobPipeline, Outcome

MODEL = "stand-in"
REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling": {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": None, "seed": None,
                        "stop": []}}


class _ActingModel:
    """Answers "ok", after running `during` (what happens to the job while it generates)."""

    def __init__(self, during: Callable[[str], None]) -> None:
        self.during = during
        self.prepared: list[GenerationRequest] = []

    def prepare(self, req: GenerationRequest) -> GenerationRequest:
        self.prepared.append(req)
        return req

    def submit(self, prepared: GenerationRequest) -> Future[GenerationResult]:
        self.during(prepared.request_id)
        future: Future[GenerationResult] = Future()
        future.set_result(GenerationResult(prepared.request_id, "ok", [1], "stop", 3, 1))
        return future

    def abort(self, request_id: str) -> None:
        pass

    def close(self, timeout: float = 10.0) -> None:
        pass


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[Settings, Database, ObjectStore]]:
    settings = Settings(data_dir=tmp_path, model=f"/models/{MODEL}", persist_retry_seconds=1)
    upgrade(settings.database_url)
    yield settings, get_database(settings.database_url), make_store(settings)


def _run(local: tuple[Settings, Database, ObjectStore], during: Callable[[str], None],
         request: dict[str, Any] = REQUEST, batch_id: str | None = None) -> tuple[str, Outcome]:
    settings, db, store = local
    with db.session() as session:
        job_id = jobs.create_job(session, model=MODEL, request=request, tenant="acme", batch_id=batch_id).id
    leases = LeaseKeeper(db, "worker-1", settings.lease_seconds, 3600)
    pipeline = JobPipeline(settings, db, store, _ActingModel(during), leases, "worker-1")
    try:
        return job_id, pipeline.run(job_id)
    finally:
        pipeline.close()


def test_a_single_job_gets_a_result_object_and_a_batch_row_only_its_row(
        local: tuple[Settings, Database, ObjectStore]) -> None:
    """A batch row's result is the row (the output file is built from rows): writing an object per row cost the
    queue more than a fast model costs."""
    _, db, store = local
    single_id, single = _run(local, lambda _: None)
    row_id, row = _run(local, lambda _: None, batch_id="batch_x")
    assert single.status == row.status == "succeeded"
    assert store.exists(result_key(single_id, "acme")) and not store.exists(result_key(row_id, "acme"))
    with db.session() as session:
        single_job, row_job = session.get(Job, single_id), session.get(Job, row_id)
        assert single_job is not None and row_job is not None
        assert single_job.result_key == result_key(single_id, "acme") and row_job.result_key is None
        assert (row_job.result_text, row_job.finish_reason, row_job.prompt_tokens, row_job.completion_tokens) == (
            "ok", "stop", 3, 1)


def test_a_job_cancelled_while_it_ran_leaves_no_result_object(local: tuple[Settings, Database, ObjectStore]) -> None:
    _, db, store = local

    def cancel(job_id: str) -> None:
        with db.session() as session:
            assert jobs.cancel(session, job_id)

    job_id, outcome = _run(local, cancel)
    assert outcome.status == "lost"
    assert not store.exists(result_key(job_id, "acme"))


def test_a_result_another_worker_now_writes_is_kept(local: tuple[Settings, Database, ObjectStore]) -> None:
    """The lease passed to another worker meanwhile: it writes (or wrote) the same key, so it stays."""
    _, db, store = local
    taken: dict[str, Any] = {}

    def take_over(job_id: str) -> None:
        with db.session() as session:
            jobs.reap(session, every_lease=True)
        with db.session() as session:
            taken["job"] = jobs.claim(session, job_id, "worker-2", 60)

    job_id, outcome = _run(local, take_over)
    assert taken["job"] is not None and outcome.status == "lost"
    assert store.exists(result_key(job_id, "acme"))
    with db.session() as session:
        assert jobs.finish(session, job_id, "worker-2", jobs.JobResult(result_key(job_id, "acme"), "ok", "stop",
                                                                      3, 1))


def test_a_job_whose_images_hold_too_many_pixels_fails_before_any_is_decoded(tmp_path: Path) -> None:
    """Compressed, a large flat image is tiny; decoded, it is width x height x 3 bytes and more. The worker reads
    the sizes from the headers and refuses the job as bad input, once, without decoding."""
    settings = Settings(data_dir=tmp_path, model=f"/models/{MODEL}", max_job_pixels=30_000)
    upgrade(settings.database_url)
    db, store = get_database(settings.database_url), make_store(settings)
    for name, size in (("wide", (200, 100)), ("small", (50, 50))):
        store.put(image_key(name), png_bytes(size=size))
    model = _ActingModel(lambda job_id: None)

    def request(*image_ids: str) -> dict[str, Any]:
        parts = [{"type": "image", "image_id": i} for i in image_ids] + [{"type": "text", "text": "what?"}]
        return {**REQUEST, "messages": [{"role": "user", "content": parts}]}

    leases = LeaseKeeper(db, "worker-1", settings.lease_seconds, 3600)
    pipeline = JobPipeline(settings, db, store, model, leases, "worker-1")
    try:
        with db.session() as session:
            over = jobs.create_job(session, model=MODEL, request=request("wide", "wide"), tenant="acme").id
            within = jobs.create_job(session, model=MODEL, request=request("wide", "small"), tenant="acme").id
        assert pipeline.run(over).status == "failed"
        assert pipeline.run(within).status == "succeeded"
    finally:
        pipeline.close()
    seen = model.prepared
    assert [r.request_id for r in seen] == [within] and [im.size for im in seen[0].images] == [(200, 100), (50, 50)]
    assert pipeline.pixels.num_held == 0
    with db.session() as session:
        failed = session.get(Job, over)
        assert failed is not None and (failed.error_code, failed.attempts) == ("invalid_input", 1)
        assert failed.error_message == ("the job's 2 images hold 40,000 pixels in all; the limit is 30,000 "
                                        "(VLMQ_MAX_JOB_PIXELS)")
