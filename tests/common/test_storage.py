"""Both object store backends behave the same; S3 runs against moto's server over HTTP."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from common.storage import LocalObjectStore, ObjectNotFound, ObjectStore, S3ObjectStore


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    endpoint = request.getfixturevalue("s3_endpoint")
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


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "", "a\\b"])
def test_keys_that_leave_the_root_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="invalid object key"):
        store.put(key, b"x")


def test_presigned_url_serves_the_object(s3_endpoint: str) -> None:
    store = S3ObjectStore(f"b-{uuid.uuid4().hex[:10]}", endpoint_url=s3_endpoint, access_key_id="testing",
                          secret_access_key="testing", create_bucket=True)
    store.put("results/job_1.json", b'{"ok": true}', content_type="application/json")
    url = store.presigned_url("results/job_1.json", 60)
    assert url is not None and url.startswith(s3_endpoint)
    response = httpx.get(url)
    assert response.status_code == 200 and response.content == b'{"ok": true}'


def test_local_store_has_no_presigned_url(tmp_path: Path) -> None:
    assert LocalObjectStore(tmp_path).presigned_url("results/x.json", 60) is None
