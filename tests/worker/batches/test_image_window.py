"""A window of ingested lines resolves its data: URL images with a few round trips, and answers each line as
store_image answered it alone: the same bytes under two URLs, an id naming an image the window just stored, a
line refused before it reached its image, an image the run's cache forgot, a race with another request.

Postgres and the S3 server as in test_ingest.py (whose helpers this reuses)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from common.domain.batch_input import LineError
from common.domain.models import ImageOwner
from common.domain.schemas import ChatCompletionRequest
from common.images import fetch
from common.images.cache import ImageCache
from common.images.pack import ImagePack
from common.images.refs import ResolvedImage
from common.images.stored import image_public_id, owned_image, store_image
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import settings_from_env
from tests.worker.batches.test_ingest import MODEL, Recorder, batch_jobs, line, line_errors, make_batch
from worker.batches import image_window
from worker.batches.image_window import WindowImages, read_window
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.jobs.image_reader import ImageReader, image_refs


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", ingest_chunk_rows=50, max_body_bytes=64 * 1024)


def fresh_png(shade: int = 0) -> bytes:
    """A picture no other test stored: image rows are shared by the whole run."""
    seed = uuid.uuid4().bytes
    return png_bytes((seed[0], seed[1], shade), (4 + seed[2] % 8, 3))


def request(*urls: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": "hi"}]}]})


def url_line(custom_id: str, *urls: str, model: str = MODEL) -> str:
    return json.dumps({"custom_id": custom_id, "body": {"model": model, **request(*urls).model_dump(
        exclude_none=True)}})


def never() -> ResolvedImage:
    raise AssertionError("a data: URL the window decoded is not resolved alone")


def test_the_same_bytes_twice_and_by_id_in_one_window(settings: Settings, db: Database, store: ObjectStore
                                                      ) -> None:
    """Two URLs of the same bytes are one image; an id naming it later in the window finds it, as it found the
    row store_image had inserted by then."""
    picture = fresh_png()
    as_id = image_public_id(hashlib.sha256(picture).hexdigest())
    lines = [url_line("png", data_url(picture)), url_line("jpeg", data_url(picture, "image/jpeg")),
             url_line("id", as_id), url_line("vlmq", f"vlmq://{as_id}")]
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == []
    refs = {job.custom_id: image_refs(job.request) for job in batch_jobs(db, batch_id)}
    assert refs["png"] == refs["jpeg"] == refs["id"] == refs["vlmq"]
    [ref] = refs["png"]
    assert ref.pack is not None and ref.pack.offset == 0 and ImageReader(store).read(ref) == picture
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(ImageOwner)
                              .where(ImageOwner.image_id == ref.sha256)) == 1


def test_remote_images_meet_the_windows_own(settings: Settings, db: Database, store: ObjectStore,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote URL serving bytes the window stored from a data: URL finds them, and a data: URL of bytes a
    remote URL brought earlier in the window is answered from them: each line as store_image answered it."""
    first, second = fresh_png(1), fresh_png(2)
    served = {"https://pictures.example/first.png": first, "https://pictures.example/second.png": second}

    class Fetcher:
        def fetch(self, url: str) -> bytes:
            return served[url]

    monkeypatch.setattr(fetch, "fetcher_for", lambda settings: Fetcher())  # refs imports it as it fetches
    remote = settings.model_copy(update={"image_urls_enabled": True})
    lines = [url_line("data-first", data_url(first)), url_line("remote-first", "https://pictures.example/first.png"),
             url_line("remote-second", "https://pictures.example/second.png"),
             url_line("data-second", data_url(second))]
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    assert ingest_batch(batch_id, IngestDeps(remote, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == []
    found = {job.custom_id: image_refs(job.request) for job in batch_jobs(db, batch_id)}
    assert found["data-first"] == found["remote-first"] and found["remote-second"] == found["data-second"]
    reader = ImageReader(store)
    assert [reader.read(found[name][0]) for name in ("data-first", "data-second")] == [first, second]


def test_a_line_refused_before_it_reaches_an_image_leaves_it_unstored(settings: Settings, db: Database,
                                                                       store: ObjectStore) -> None:
    """Images are stored when a line reaches them, as before: not those of a line refused first (its model),
    nor those after a bad image of the same line, nor past the job's image limit."""
    other_model, after_junk, past_limit, good = fresh_png(1), fresh_png(2), fresh_png(3), fresh_png(4)
    junk = fresh_png(5)[:40]
    few = settings.model_copy(update={"max_images_per_job": 2})
    lines = [url_line("model", data_url(other_model), model="another-model"),
             url_line("junk-first", data_url(junk), data_url(after_junk)),
             url_line("three", data_url(good), data_url(good), data_url(past_limit)),
             url_line("ok", data_url(good))]
    batch_id = make_batch(db, store, ("\n".join(lines) + "\n").encode())
    assert ingest_batch(batch_id, IngestDeps(few, db, store, Recorder())) == "in_progress"
    assert line_errors(db, batch_id) == [(1, "model", "model_not_found"), (2, "junk-first", "invalid_image"),
                                         (3, "three", "too_many_images")]
    with db.session() as session:
        for unreached in (other_model, after_junk, past_limit):
            assert owned_image(session, "default", hashlib.sha256(unreached).hexdigest()) is None
        assert owned_image(session, "default", hashlib.sha256(good).hexdigest()) is not None


def test_an_image_the_runs_cache_forgot_is_looked_up_alone(settings: Settings, db: Database, store: ObjectStore
                                                           ) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    first, second = data_url(fresh_png()), data_url(fresh_png())
    cache: ImageCache[ResolvedImage] = ImageCache(max_entries=1)
    with db.session() as session:
        window = WindowImages(session, store, settings, tenant, None, cache)
        window.add(request(first))
        window.lookup()
        stored = window.resolve(first, never)
        window.store()
        window = WindowImages(session, store, settings, tenant, None, cache)
        window.add(request(first, second))  # `first` is the cache's: not decoded again
        window.lookup()
        window.resolve(second, never)  # past max_entries: `first` is forgotten
        assert first not in cache
        assert window.resolve(first, never) == stored  # the tenant's row, found by a lookup of its own
        window.store()
    assert stored.pack is None
    assert ImageReader(store).read(image_refs({"messages": [{"content": [stored.as_part()]}]})[0])


def test_an_owner_row_written_meanwhile_keeps_this_copys_location(settings: Settings, db: Database,
                                                                  store: ObjectStore) -> None:
    """Another request of the tenant stores the image between the window's lookup and its INSERT: the INSERT
    skips the owner row, and the line keeps the copy this window packed, as store_image answers then."""
    tenant, picture = f"t-{uuid.uuid4().hex[:8]}", fresh_png()
    pack = ImagePack(store, 1 << 20)
    with db.session() as session:
        window = WindowImages(session, store, settings, tenant, pack, ImageCache())
        window.add(request(data_url(picture)))
        window.lookup()
        with db.session() as other:
            theirs = store_image(other, store, picture, settings, tenant)
        resolved = window.resolve(data_url(picture), never)
        window.store()
        pack.flush()
    assert theirs.pack is None and resolved.pack is not None and resolved.sha256 == theirs.id
    assert ImageReader(store).read(image_refs({"messages": [{"content": [resolved.as_part()]}]})[0]) == picture
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(ImageOwner)
                              .where(ImageOwner.image_id == theirs.id)) == 1


def test_a_window_ends_at_its_line_or_size_limit(settings: Settings, db: Database, store: ObjectStore,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def numbered(items: list[str | LineError]) -> Iterator[tuple[int, str | LineError]]:
        return iter(enumerate(items, start=1))

    texts = [line(f"w{i:03}") for i in range(150)]
    lines: list[str | LineError] = list(texts)
    with db.session() as session:
        window = WindowImages(session, store, settings, "default", None, ImageCache())
        source = numbered(lines)
        assert [len(read_window(source, window)) for _ in range(4)] == [64, 64, 22, 0]
        monkeypatch.setattr(image_window, "WINDOW_CHARS", 3 * len(texts[0]))
        source = numbered([LineError(1, None, "line_too_long", "too long"), *lines[:10]])
        assert [len(read_window(source, window)) for _ in range(5)] == [4, 3, 3, 1, 0]
