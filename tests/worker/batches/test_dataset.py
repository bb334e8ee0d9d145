"""Native datasets (manifest + image archive) through ingestion, on Postgres and the S3 server, no model."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from common.domain.batch_input import LineError
from common.domain.files import add_file, file_key
from common.domain.models import Batch, BatchLineError, new_file_id
from common.images.stored import owned_image
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from tests.api.test_jobs_api import png_bytes
from tests.conftest import settings_from_env
from tests.worker.batches.test_ingest import MODEL, Recorder, batch_jobs, get_batch, line_errors
from worker.batches.archive import normalize_path
from worker.batches.dataset import iter_csv_lines
from worker.batches.ingest import IngestDeps, ingest_batch
from worker.jobs.image_reader import ImageReader, image_refs

RED, GREEN = png_bytes((200, 0, 0), (8, 6)), png_bytes((0, 200, 0), (6, 8))


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", ingest_chunk_rows=2)


def upload(db: Database, store: ObjectStore, data: bytes, filename: str) -> str:
    file_id = new_file_id()
    store.put(file_key(file_id, "default"), data)
    with db.session() as session:
        add_file(session, file_id=file_id, key=file_key(file_id, "default"), size=len(data),
                 filename=filename, purpose="batch",
                 tenant="default")
    return file_id


def dataset_batch(db: Database, store: ObjectStore, manifest: bytes, manifest_name: str, archive: bytes) -> str:
    from common.domain import batches

    input_id = upload(db, store, manifest, manifest_name)
    images_id = upload(db, store, archive, "images.bin")
    with db.session() as session:
        return batches.create_batch(session, input_file_id=input_id, endpoint="/v1/chat/completions",
                                    completion_window="24h", model=MODEL, metadata=None,
                                    images_file_id=images_id).id


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def tar_gz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def path_line(custom_id: str, *paths: str) -> str:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": p}} for p in paths]
    content.append({"type": "text", "text": "what is it"})
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 2}})


def image_ids(db: Database, batch_id: str) -> dict[str, list[str]]:
    return {j.custom_id or "": [p["image_id"] for m in j.request["messages"] for p in m["content"]
                                if p["type"] == "image"] for j in batch_jobs(db, batch_id)}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_paths_have_one_spelling() -> None:
    assert normalize_path("./a\\b//c.png") == "a/b/c.png"
    assert normalize_path("/abs/x.png") == "abs/x.png"
    assert normalize_path("a/../../etc/passwd") is None
    assert normalize_path("cafe\u0301.png") == "caf\u00e9.png"  # NFD (macOS) == NFC


def test_zip_with_a_top_folder_and_jsonl_paths(settings: Settings, db: Database, store: ObjectStore) -> None:
    archive = zip_bytes({
        "ds/": b"", "ds/images/red.png": RED, "ds/images/green.png": GREEN, "ds/images/red-again.png": RED,
        "ds/images/broken.png": RED[:40], "ds/notes.txt": b"not an image", "__MACOSX/ds/._red.png": b"junk",
    })
    manifest = "\n".join([
        path_line("a", "images/red.png"), path_line("b", "ds/images/green.png", "./images/red-again.png"),
        path_line("c", "images/missing.png"), path_line("d", "images/broken.png"), path_line("e", "notes.txt"),
    ]).encode()
    batch_id = dataset_batch(db, store, manifest, "manifest.jsonl", archive)
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert image_ids(db, batch_id) == {"a": [sha(RED)], "b": [sha(GREEN), sha(RED)]}
    errors = {cid: code for _, cid, code in line_errors(db, batch_id)}
    assert errors == {"c": "image_not_found", "d": "invalid_image", "e": "invalid_image"}
    batch = get_batch(db, batch_id)
    assert batch.images_root == "ds" and batch.images_indexed_at is not None
    with db.session() as session:  # the archive's images are the batch tenant's, and no one else's
        assert owned_image(session, "default", sha(GREEN)) is not None
        assert owned_image(session, "someone-else", sha(GREEN)) is None
    # Each job's images read back from where its request says they lie (a pack, unless an earlier test stored
    # them first); the reader checks the bytes against the id.
    reader = ImageReader(store)
    assert all(reader.read(ref) for job in batch_jobs(db, batch_id) for ref in image_refs(job.request))


def test_tar_gz_with_a_csv_manifest(settings: Settings, db: Database, store: ObjectStore) -> None:
    archive = tar_gz_bytes({"red.png": RED, "sub/green.png": GREEN})
    manifest = (
        b"custom_id,image,prompt,max_tokens,system\r\n"
        b'one,red.png,"a prompt, with a comma\nand a new line",3,\r\n'
        b"two,red.png|sub/green.png,two images,,be brief\r\n"
        b",sub/green.png,no custom id,2,\r\n"
        b"bad,red.png,too many,1,,extra\r\n"
        b"worse,red.png,bad number,x,\r\n"
    )
    batch_id = dataset_batch(db, store, manifest, "rows.CSV", archive)
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert image_ids(db, batch_id) == {"one": [sha(RED)], "two": [sha(RED), sha(GREEN)], "line-5": [sha(GREEN)]}
    jobs = {j.custom_id: j for j in batch_jobs(db, batch_id)}
    assert jobs["one"].request["messages"][0]["content"][1]["text"] == "a prompt, with a comma\nand a new line"
    assert jobs["one"].request["sampling"]["max_tokens"] == 3
    assert jobs["two"].request["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert [(n, code) for n, _, code in line_errors(db, batch_id)] == [(6, "invalid_csv"), (7, "invalid_request")]


@pytest.mark.parametrize(("manifest", "name", "archive", "code"), [
    (path_line("a", "red.png").encode(), "m.jsonl", b"this is no archive at all" * 40, "invalid_archive"),
    (b"prompt,colour\nhi,red\n", "m.csv", zip_bytes({"red.png": RED}), "invalid_manifest"),
])
def test_unusable_datasets_fail(settings: Settings, db: Database, store: ObjectStore, manifest: bytes, name: str,
                                archive: bytes, code: str) -> None:
    batch_id = dataset_batch(db, store, manifest, name, archive)
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "failed"
    batch: Batch = get_batch(db, batch_id)
    assert batch.errors and batch.errors[0]["code"] == code and batch.errors[0]["message"]


def test_csv_lines_are_openai_lines() -> None:
    data = b"\xef\xbb\xbfprompt,image\nhello,a.png\n\n\xff\xfe,x\nlast,b.png"
    for size in (5, len(data)):
        got = list(iter_csv_lines([data[i:i + size] for i in range(0, len(data), size)], 10_000))
        assert [(n, item if isinstance(item, str) else item.code) for n, item in got][1:] == [
            (4, "invalid_utf8"), (5, got[2][1])]
        assert json.loads(got[0][1])["body"]["messages"][0]["content"] == [  # type: ignore[arg-type]
            {"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": "hello"}]
        assert got[0][0] == 2 and json.loads(got[2][1])["custom_id"] == "line-5"  # type: ignore[arg-type]


def test_an_open_quote_says_which_lines_its_record_took() -> None:
    data = b'custom_id,prompt,max_tokens\nk1,fine,3\nk2,"left open,3\nk3,swallowed,3\nk4,also swallowed,3'
    got = list(iter_csv_lines([data], 10_000))
    assert [n for n, _ in got] == [2, 3]
    error = got[1][1]
    assert isinstance(error, LineError) and error.code == "invalid_csv"
    assert error.message.startswith("lines 3-5 (a quoted field runs across them)")


def _messages(db: Database, batch_id: str) -> dict[str | None, tuple[str, str]]:
    with db.session() as session:
        rows = session.scalars(select(BatchLineError).where(BatchLineError.batch_id == batch_id))
        return {e.custom_id: (e.code, e.message) for e in rows}


def test_hostile_archive_members_are_per_line_errors(settings: Settings, db: Database, store: ObjectStore) -> None:
    escape = f"../../../../tmp/vlmq-escape-{uuid.uuid4().hex}.png"
    link = zipfile.ZipInfo("link.png")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in ((link, b"/etc/passwd"), (escape, RED), ("/etc/passwd", RED), ("red.png", RED)):
            zf.writestr(name, data)
    manifest = "\n".join([path_line("a", "red.png"), path_line("b", "link.png"), path_line("c", escape),
                          path_line("d", "etc/passwd")]).encode()
    batch_id = dataset_batch(db, store, manifest, "m.jsonl", buf.getvalue())
    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    assert image_ids(db, batch_id) == {"a": [sha(RED)]}
    errors = _messages(db, batch_id)
    assert errors["b"][0] == "invalid_image" and "symbolic link" in errors["b"][1]
    assert errors["c"][0] == "invalid_path" and "climbs out" in errors["c"][1]
    assert errors["d"][0] == "invalid_image" and "absolute path" in errors["d"][1]
    assert not Path("/tmp", Path(escape).name).exists()


@pytest.mark.parametrize(("caps", "fragment"), [
    ({"archive_max_entries": 2}, "archive_max_entries"),
    ({"archive_max_total_bytes": 1024}, "archive_max_total_bytes"),
])
def test_archive_over_a_cap_fails_the_batch(settings: Settings, db: Database, store: ObjectStore,
                                            caps: dict[str, int], fragment: str) -> None:
    members = {f"{i}.png": png_bytes((i, 0, 0), (40, 40)) for i in range(5)}
    batch_id = dataset_batch(db, store, path_line("a", "0.png").encode(), "m.jsonl", tar_gz_bytes(members))
    capped = settings.model_copy(update=caps)
    assert ingest_batch(batch_id, IngestDeps(capped, db, store, Recorder())) == "failed"
    batch = get_batch(db, batch_id)
    assert batch.errors and batch.errors[0]["code"] == "invalid_archive" and fragment in batch.errors[0]["message"]
