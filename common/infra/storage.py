"""Object storage: S3 (any endpoint: AWS, MinIO, moto) or a local folder, behind one small interface.

Keys are ours (`images/<sha256>`, `packs/<id>` (common/images/pack.py), `tenants/<tenant>/results/<job_id>.json`,
...), but the local backend still refuses any key that would leave its root.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from common.infra.settings import Settings

if TYPE_CHECKING:
    from botocore.exceptions import ClientError


class ObjectNotFound(KeyError):
    pass


class ObjectStore(Protocol):
    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, start: int, size: int) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def presigned_url(self, key: str, expires_seconds: int) -> str | None: ...
    def check(self) -> None: ...


def client_error() -> type[ClientError]:
    """botocore's ClientError, for `except client_error()` (evaluated only when something was raised): boto3
    is imported by the processes that use S3, not by every vlmq command."""
    from botocore.exceptions import ClientError as LoadedClientError

    return cast("type[ClientError]", LoadedClientError)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise ValueError(f"invalid object key: {key!r}")
    return key


class LocalObjectStore:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees half an object and a crash leaves no torn file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def get_range(self, key: str, start: int, size: int) -> bytes:
        """`size` bytes from `start` (fewer where the object ends first)."""
        try:
            with self._path(key).open("rb") as f:
                f.seek(start)
                return f.read(size)
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        return None  # a local folder has no URL; the API streams the bytes instead

    def check(self) -> None:
        probe = self.root / ".readyz"
        probe.write_bytes(b"ok")
        probe.unlink()


class S3ObjectStore:
    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        create_bucket: bool = False,
        max_connections: int = 64,
        max_attempts: int = 5,
    ) -> None:
        self.bucket = bucket
        self.client = self._client(endpoint_url, region, access_key_id, secret_access_key, max_connections,
                                   max_attempts, "when_supported")
        # Ranged reads have a client of their own: some servers (rclone's) send the whole object's checksum with
        # a part of it, which botocore would check the part against. Their callers check what they read
        # themselves (worker/jobs/image_reader.py hashes each image). Made now, not by a worker's first chunk.
        self._range_client = self._client(endpoint_url, region, access_key_id, secret_access_key, max_connections,
                                          max_attempts, "when_required")
        if create_bucket:
            self._ensure_bucket(region)

    @staticmethod
    def _client(endpoint_url: str | None, region: str, access_key_id: str | None, secret_access_key: str | None,
                max_connections: int, max_attempts: int, checksum_validation: str) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=Config(
                retries={"max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=5,
                read_timeout=60,
                s3={"addressing_style": "path"},
                # Presigned URLs default to SigV2 here, which S3 regions opened since 2014 and rclone's
                # server refuse ("UnsupportedAlgorithm"); SigV4 is accepted everywhere.
                signature_version="s3v4",
                # One client serves all of a process's threads. With botocore's default of 10 pooled
                # connections, a worker running 64-256 jobs at once closed most connections after each
                # request and opened a new one for the next (urllib3 logs "Connection pool is full").
                max_pool_connections=max_connections,
                response_checksum_validation=checksum_validation,
            ),
        )

    def _ensure_bucket(self, region: str) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise
        kwargs: dict[str, object] = {"Bucket": self.bucket}
        if region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(**kwargs)
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.client.put_object(Bucket=self.bucket, Key=_check_key(key), Body=data, ContentType=content_type)

    def get(self, key: str) -> bytes:
        return self._get(key)

    def get_range(self, key: str, start: int, size: int) -> bytes:
        """`size` bytes from `start` (fewer where the object ends first)."""
        if size <= 0:
            return b""
        return self._get(key, self._range_client, Range=f"bytes={start}-{start + size - 1}")

    def _get(self, key: str, client: Any = None, **kwargs: str) -> bytes:
        try:
            response = (client or self.client).get_object(Bucket=self.bucket, Key=_check_key(key), **kwargs)
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(key) from None
            raise
        data: bytes = response["Body"].read()
        return data

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=_check_key(key))
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=_check_key(key))

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": _check_key(key)}, ExpiresIn=expires_seconds
        )
        return url

    def check(self) -> None:
        self.client.head_bucket(Bucket=self.bucket)


def store_connections(settings: Settings) -> int:
    """Connections an S3 client keeps for reuse: enough for every thread of any vlmq process to hold one (a
    worker's jobs in flight, the API's thread pool of 40, an ingest worker's tasks), with room for the
    heartbeat and follow-up threads. The pool only keeps connections that were opened, so a large bound
    costs nothing while idle."""
    return max(64, settings.worker_concurrency + 16, settings.ingest_concurrency + 16)


def make_store(settings: Settings) -> ObjectStore:
    if settings.storage_backend == "s3":
        return S3ObjectStore(
            settings.s3_bucket,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            create_bucket=settings.s3_create_bucket,
            max_connections=store_connections(settings),
        )
    assert settings.storage_dir is not None
    return LocalObjectStore(settings.storage_dir)


def image_key(sha256: str) -> str:
    return f"images/{sha256}"


def tenant_prefix(tenant: str) -> str:
    """Every object of a tenant's lies under this (bucket policies and audits can follow tenants); images and
    their packs are the exception: stored once by content hash, shared by every job that uses the same bytes."""
    return f"tenants/{tenant}/"


def result_key(job_id: str, tenant: str) -> str:
    return f"{tenant_prefix(tenant)}results/{job_id}.json"
