"""A batch's cancel stops its rows a worker has claimed: on Postgres and the S3 server, in SQL alone, then with
the tiny LLaVA on the paged engine behind a worker's chunk runner.

What OpenAI's cancel promises: the batch ends `cancelled`, what completed before stays in the output file, the
rest goes to the error file as `batch_cancelled`. Here nothing claimed runs on after the cancel: its rows end
`cancelled` with no result, the batch ends without waiting for any worker, and the engine drops their
requests, those still waiting for a slot included, freeing every KV block.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from common.domain import batches, jobs
from common.domain.models import Job, JobStatus
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from tests.conftest import settings_from_env
from tests.worker.batches.test_ingest import (
    MODEL,
    Recorder,
    _finish,
    _read_jsonl,
    batch_jobs,
    get_batch,
    make_batch,
)
from worker.batches.finalize import cancel_batch_jobs, finalize_batch
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.engine.core.config import EngineConfig
from worker.engine.core.scheduler_output import SchedulerOutput
from worker.engine.engine import Engine
from worker.engine.service import EngineService
from worker.inference.model_loader import load_model
from worker.jobs.chunk_runner import ChunkRunner
from worker.jobs.group import JobGroupRunner
from worker.jobs.leases import LeaseKeeper
from worker.jobs.pipeline import Ending, JobPipeline, Outcome

LATE = jobs.JobResult(None, "too late", "stop", 1, 1)


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", ingest_chunk_rows=3)


def _line(custom_id: str, text: str, max_tokens: int) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": [
                           {"type": "text", "text": text}]}], "max_tokens": max_tokens}})


def _status(db: Database, job_id: str) -> str | None:
    with db.session() as session:
        return session.scalar(select(Job.status).where(Job.id == job_id))


def _ingested(settings: Settings, db: Database, store: ObjectStore, lines: list[str]) -> tuple[str, list[str]]:
    """A batch in progress: its id and its rows' ids, in line order."""
    batch_id = make_batch(db, store, "\n".join(lines).encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    rows = sorted(batch_jobs(db, batch_id), key=lambda job: int((job.custom_id or "").rsplit("-", 1)[1]))
    return batch_id, [job.id for job in rows]


def test_cancel_stops_running_rows_and_ends_the_batch_without_waiting(settings: Settings, db: Database,
                                                                      store: ObjectStore) -> None:
    batch_id, rows = _ingested(settings, db, store, [_line(f"r-{i}", f"row {i}", 3) for i in range(8)])
    done = rows[0]
    _finish(db, store, next(job for job in batch_jobs(db, batch_id) if job.id == done), "done before the cancel")
    running = [job_id for job_id in rows if job_id != done][:3]
    with db.session() as session:
        assert len(jobs.claim_many(session, running, "w", 60)) == 3  # a worker's chunk holds them
        assert batches.request_cancel(session, batch_id)
    told: list[str] = []
    queued = [job_id for job_id in rows if job_id not in (done, *running)]

    def tell_workers() -> None:
        told.append("told")
        if len(told) == 1:  # while the cancel goes through: a worker claims a queued row dispatch had sent
            with db.session() as session:
                assert jobs.claim(session, queued[0], "w2", 60) is not None

    assert cancel_batch_jobs(batch_id, db, tell_workers) == 7
    assert told == ["told", "told"]  # once for the running rows, again for the one claimed meanwhile
    assert finalize_batch(batch_id, db, store) == "cancelled"  # at once: no worker to wait for
    with db.session() as session:
        assert not jobs.finish_many(session, "w", dict.fromkeys(running, LATE))  # the workers' finishes: refused
        assert not jobs.finish(session, queued[0], "w2", LATE)
    by_id = {job.id: job for job in batch_jobs(db, batch_id)}
    assert by_id[done].status == JobStatus.SUCCEEDED and by_id[done].result_text == "done before the cancel"
    assert all(job.status == JobStatus.CANCELLED and job.result_text is None and job.lease_owner is None
               for job_id, job in by_id.items() if job_id != done)
    batch = get_batch(db, batch_id)
    assert [line["custom_id"] for line in _read_jsonl(store, db, batch.output_file_id or "")] == ["r-0"]
    errors = _read_jsonl(store, db, batch.error_file_id or "")
    assert sorted(e["custom_id"] for e in errors) == [f"r-{i}" for i in range(1, 8)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert (batch.completed_requests, batch.failed_requests) == (1, 0)


def test_a_cancel_whose_workers_cannot_be_told_still_cancels(settings: Settings, db: Database,
                                                             store: ObjectStore) -> None:
    batch_id, rows = _ingested(settings, db, store, [_line(f"r-{i}", f"row {i}", 3) for i in range(2)])
    with db.session() as session:
        assert jobs.claim(session, rows[0], "w", 60) is not None
        assert batches.request_cancel(session, batch_id)

    def broker_down() -> None:
        raise ConnectionError("the broker is away")

    assert cancel_batch_jobs(batch_id, db, broker_down) == 2  # the heartbeat finds them instead
    assert finalize_batch(batch_id, db, store) == "cancelled"


def test_rows_claimed_in_a_worker_are_aborted_in_its_engine(settings: Settings, db: Database, store: ObjectStore,
                                                            tiny_llava_path: Path) -> None:
    """One row answered before the cancel; six more claimed by the same chunk: two generating, four waiting in
    the engine for a slot. The worker's heartbeat is an hour away: what stops them is the cancel telling it."""
    lines = [_line("r-0", "quick one", 2)] + [_line(f"r-{i}", f"tell me a long story {i}", 400) for i in range(1, 7)]
    batch_id, rows = _ingested(settings, db, store, lines)
    engine = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, block_size=8, max_num_seqs=2))
    started: list[str] = []  # requests the engine ever scheduled, in order
    execute = engine.runner.execute

    def recording_execute(out: SchedulerOutput) -> Any:
        started.extend(new.request_id for new in out.new_requests)
        return execute(out)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    service = EngineService(engine)
    leases = LeaseKeeper(db, "gpu-worker", 600, 3600, on_lost=service.abort)
    pipeline = JobPipeline(settings, db, store, service, leases, "gpu-worker")
    runner = ChunkRunner(pipeline, JobGroupRunner(pipeline, 8))
    result: list[list[Outcome | Exception]] = []
    chunk = threading.Thread(target=lambda: result.append(runner.run(rows)))
    chunk.start()
    try:
        deadline = time.monotonic() + 60
        while not (_status(db, rows[0]) == JobStatus.SUCCEEDED
                   and engine.scheduler.num_running + engine.scheduler.num_waiting == 6):
            assert time.monotonic() < deadline, started
            time.sleep(0.005)
        assert engine.scheduler.num_waiting == 4
        with db.session() as session:  # what the cancel task does: cancel, tell the workers, finalize
            assert batches.request_cancel(session, batch_id)
        assert cancel_batch_jobs(batch_id, db, tell_workers=leases.check_soon) == 6
        assert finalize_batch(batch_id, db, store) == "cancelled"
        chunk.join(60)
        assert not chunk.is_alive()
    finally:
        chunk.join(60)
        runner.pool.close()
        pipeline.close()
        leases.close()
        service.close()
    assert [o.status if isinstance(o, Outcome) else o for o in result[0]] == [JobStatus.SUCCEEDED] + [Ending.LOST] * 6
    assert not any(o.retry for o in result[0] if isinstance(o, Outcome))  # nothing is run again
    # Aborted, not run to their end: only the quick row finished. The rows that waited never started, but for
    # the two slots the first aborts free, should the engine step before the others' aborts reach it.
    assert engine.stats.num_finished == 1 and started[:3] == rows[:3] and len(started) <= 3 + 2, started
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    by_id = {job.id: job for job in batch_jobs(db, batch_id)}
    assert by_id[rows[0]].status == JobStatus.SUCCEEDED and by_id[rows[0]].completion_tokens
    assert all(by_id[j].status == JobStatus.CANCELLED and by_id[j].result_text is None for j in rows[1:])
    assert all(by_id[j].error_code is None for j in rows)  # no worker reported a failure
    batch = get_batch(db, batch_id)
    assert [line["custom_id"] for line in _read_jsonl(store, db, batch.output_file_id or "")] == ["r-0"]
    assert [e["error"]["code"] for e in _read_jsonl(store, db, batch.error_file_id or "")] == ["batch_cancelled"] * 6

