"""The ingestion fast paths keep its behaviour: the per-run image cache, the one-statement bulk insert on
Postgres, INSERT .. ON CONFLICT for new images. Postgres from the test services, plus SQLite."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from common.domain.models import ImageOwner, ImageRecord, Job
from common.domain.submission import SubmissionError
from common.images.cache import ImageCache
from common.images.stored import owned_image, store_image
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store
from tests.api.test_jobs_api import png_bytes
from tests.conftest import settings_from_env
from tests.worker.batches.test_ingest import MODEL, Recorder, batch_jobs, get_batch, line, line_errors, make_batch
from worker.batches.ingest import IngestDeps, ingest_batch


def test_cache_resolves_each_reference_once_and_repeats_refusals() -> None:
    cache: ImageCache[str] = ImageCache(max_entries=2)
    calls: list[str] = []

    def ok(url: str) -> str:
        calls.append(url)
        return f"id-{url[-1]}"

    def bad() -> str:
        calls.append("bad")
        raise SubmissionError("image is truncated or corrupt", 400, "invalid_image")

    assert [cache.resolve("data:a", lambda: ok("data:a")) for _ in range(3)] == ["id-a"] * 3
    for _ in range(2):
        with pytest.raises(SubmissionError) as refused:
            cache.resolve("data:bad", bad)
        assert (refused.value.code, refused.value.status_code, str(refused.value)) == (
            "invalid_image", 400, "image is truncated or corrupt")
        assert refused.value.__context__ is None  # no frames (and image bytes) kept alive through the cache
    assert calls == ["data:a", "bad"] and (cache.hits, cache.misses) == (3, 2)
    cache.resolve("data:c", lambda: ok("data:c"))  # past max_entries: the oldest ("data:a") goes
    assert cache.resolve("data:a", lambda: ok("data:a")) == "id-a" and calls[-1] == "data:a"
    # Remote URLs are never cached: what they serve may change.
    assert [cache.resolve("https://x/y.png", lambda: ok("https://x/y.png")) for _ in range(2)] == ["id-g"] * 2
    assert calls.count("https://x/y.png") == 2


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest, service_env: dict[str, str], tmp_path: Path
            ) -> tuple[Settings, Database, ObjectStore]:
    overrides: dict[str, object] = {"model": f"/models/{MODEL}", "ingest_chunk_rows": 3,
                                    "max_body_bytes": 64 * 1024}
    if request.param == "sqlite":
        overrides["database_url"] = f"sqlite:///{tmp_path / 'vlmq.db'}"
        upgrade(str(overrides["database_url"]))
    settings = settings_from_env(service_env, **overrides)
    return settings, get_database(settings.database_url), make_store(settings)


def test_a_reused_bad_image_is_refused_on_every_line(backend: tuple[Settings, Database, ObjectStore]) -> None:
    settings, db, store = backend
    red, junk = png_bytes((250, 1, 1), (9, 7)), png_bytes()[:40]  # a truncated PNG
    lines = [line(f"c{i}", image=junk if i % 2 else red) for i in range(8)]  # across three chunks
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == [(n, f"c{n - 1}", "invalid_image") for n in (2, 4, 6, 8)]
    created = batch_jobs(db, batch_id)
    assert sorted(j.custom_id or "" for j in created) == ["c0", "c2", "c4", "c6"]
    assert {j.request["messages"][0]["content"][0]["image_id"] for j in created} == {store_image_id(red)}
    assert get_batch(db, batch_id).refused_requests == 4
    with db.session() as session:
        assert session.get(ImageRecord, store_image_id(red)) is not None


def store_image_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_bulk_rows_read_back_as_the_orm_writes_them(backend: tuple[Settings, Database, ObjectStore]) -> None:
    settings, db, store = backend
    body: dict[str, Any] = {"temperature": 0.5, "stop": ["\u00e9t\u00e9", "\"q\"\n"]}
    batch_id = make_batch(db, store, (line("u1", text="caf\u00e9 \\ \"x\" \u2603", **body) + "\n").encode())
    ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder()))
    (job,) = batch_jobs(db, batch_id)
    assert job.request["messages"][0]["content"][0]["text"] == "caf\u00e9 \\ \"x\" \u2603"
    assert job.request["sampling"]["stop"] == ["\u00e9t\u00e9", "\"q\"\n"]
    assert job.metadata_ is None and job.idempotency_key is None and job.created_at.tzinfo is not None
    with db.session() as session:
        # None in a JSON column is the JSON null, as SQLAlchemy's own insert writes it.
        assert session.scalar(text("SELECT metadata IS NULL FROM jobs WHERE id = :id"), {"id": job.id}) in (False, 0)
        assert session.scalar(select(Job.status).where(Job.id == job.id)) == "queued"


def test_store_image_twice_and_by_two_tenants_returns_the_row(backend: tuple[Settings, Database, ObjectStore]
                                                              ) -> None:
    settings, db, store = backend
    data = png_bytes((3, 4, 5), (5, 6))
    with db.session() as session:
        first = store_image(session, store, data, settings, "t-first")
    with db.session() as session:
        again = store_image(session, store, data, settings, "t-first")
    assert (first.id, first.width, first.height, first.format) == (again.id, 5, 6, "PNG")
    with db.session() as session:
        assert owned_image(session, "t-second", first.id) is None
        # The image row exists: its INSERT does nothing, and the second tenant owns it too, from now on.
        other = store_image(session, store, data, settings, "t-second")
    assert (other.id, other.width, other.size_bytes) == (first.id, 5, len(data))
    assert other.created_at > first.created_at
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(ImageRecord).where(ImageRecord.id == first.id)) == 1
        assert {o.tenant for o in session.scalars(select(ImageOwner).where(ImageOwner.image_id == first.id))} == {
            "t-first", "t-second"}
