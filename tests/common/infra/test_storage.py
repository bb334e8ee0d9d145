"""Both object store backends behave the same; S3 runs over HTTP against moto's server and against rclone's
(a Go implementation, as MinIO is)."""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from common.infra.settings import Settings
from common.infra.storage import LocalObjectStore, ObjectNotFound, ObjectStore, S3ObjectStore, make_store

S3_ENDPOINTS = ["s3_endpoint", "rclone_s3_endpoint"]


@pytest.fixture(params=["local", *S3_ENDPOINTS])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    endpoint = request.getfixturevalue(request.param)
    return S3ObjectStore(f"b-{uuid.uuid4().hex[:10]}", endpoint_url=endpoint, access_key_id="testing",
                         secret_access_key="testing", create_bucket=True)


def test_put_get_exists_delete(store: ObjectStore) -> None:
    store.check()
    assert not store.exists("images/abc")
    store.put("images/abc", b"\x00\x01payload", content_type="image/png")
    assert store.exists("images/abc")
    assert store.get("images/abc") == b"\x00\x01payload"
    store.put("images/abc", b"second")  # deterministic keys are overwritten, never duplicated
    assert store.get("images/abc") == b"second"
    store.delete("images/abc")
    assert not store.exists("images/abc")
    with pytest.raises(ObjectNotFound):
        store.get("images/abc")


def test_get_range_reads_part_of_an_object(store: ObjectStore) -> None:
    store.put("packs/p1", b"0123456789")
    assert store.get_range("packs/p1", 0, 3) == b"012"
    assert store.get_range("packs/p1", 4, 4) == b"4567"
    assert store.get_range("packs/p1", 8, 10) == b"89"  # cut short where the object ends
    assert store.get_range("packs/p1", 3, 0) == b""
    with pytest.raises(ObjectNotFound):
        store.get_range("packs/none", 0, 3)


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "", "a\\b"])
def test_keys_that_leave_the_root_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        store.put(key, b"x")


@pytest.mark.parametrize("server", S3_ENDPOINTS)
def test_presigned_url_serves_the_object(server: str, request: pytest.FixtureRequest) -> None:
    s3_endpoint = request.getfixturevalue(server)
    store = S3ObjectStore(f"b-{uuid.uuid4().hex[:10]}", endpoint_url=s3_endpoint, access_key_id="testing",
                          secret_access_key="testing", create_bucket=True)
    store.put("results/job_1.json", b'{"ok": true}', content_type="application/json")
    url = store.presigned_url("results/job_1.json", 60)
    assert url is not None and url.startswith(s3_endpoint)
    response = httpx.get(url)
    assert response.status_code == 200 and response.content == b'{"ok": true}'


def test_local_store_has_no_presigned_url(tmp_path: Path) -> None:
    assert LocalObjectStore(tmp_path).presigned_url("results/x.json", 60) is None


def test_s3_connections_are_reused_by_many_threads(s3_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's jobs in flight share one client: 48 threads at once must not exhaust its pool, or each
    request past the pool's size opens a new connection and throws it away (urllib3 warns so)."""
    settings = Settings(storage_backend="s3", s3_endpoint_url=s3_endpoint, s3_bucket=f"b-{uuid.uuid4().hex[:10]}",
                        s3_access_key_id="testing", s3_secret_access_key="testing", worker_concurrency=48)
    store = make_store(settings)
    assert isinstance(store, S3ObjectStore)
    assert store.client.meta.config.max_pool_connections >= 48 + 16

    def round_trip(i: int) -> bytes:
        store.put(f"results/job_{i}.json", str(i).encode())
        return store.get(f"results/job_{i}.json")

    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"), ThreadPoolExecutor(48) as pool:
        for _ in range(3):
            assert list(pool.map(round_trip, range(48))) == [str(i).encode() for i in range(48)]
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]


def test_the_default_pool_would_have_been_exhausted(s3_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    """The check above can fail: with botocore's default pool of 10, the same load is warned about."""
    store = S3ObjectStore(f"b-{uuid.uuid4().hex[:10]}", endpoint_url=s3_endpoint, access_key_id="testing",
                          secret_access_key="testing", create_bucket=True, max_connections=10)
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"), ThreadPoolExecutor(48) as pool:
        list(pool.map(lambda i: store.put(f"results/job_{i}.json", b"x"), range(96)))
    assert [r for r in caplog.records if "pool is full" in r.getMessage()]
