"""Files of the OpenAI Files API: streaming to and from object storage, rows and the file object.

Uploads, batch inputs and batch outputs can be far larger than a worker's or the API's memory, so objects are
written and read in pieces here. ObjectStore only moves whole objects; these helpers reach into its two
backends (S3 multipart upload, a temp file renamed into place) and belong in common/infra/storage.py's interface
once that grows streaming methods.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session

from common.domain.file_expiry import ExpiresAfter
from common.domain.models import FileRecord, utcnow
from common.infra.db import Database
from common.infra.storage import (
    LocalObjectStore,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    client_error,
    tenant_prefix,
)

# S3 refuses multipart parts under 5 MiB (except the last); 8 MiB keeps a writer's memory small and the
# number of parts of a 200 MB upload far below S3's 10,000.
PART_BYTES = 8 * 1024 * 1024
READ_CHUNK_BYTES = 1024 * 1024


class ObjectWriter(Protocol):
    def write(self, data: bytes) -> None: ...
    def close(self) -> int:
        """Make the object visible; returns its size in bytes."""
        ...

    def abort(self) -> None: ...


class _S3Writer:
    def __init__(self, store: S3ObjectStore, key: str, content_type: str) -> None:
        self.store, self.key, self.content_type = store, key, content_type
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.size = 0

    def write(self, data: bytes) -> None:
        self.buffer += data
        self.size += len(data)
        while len(self.buffer) >= PART_BYTES:
            self._upload_part(bytes(self.buffer[:PART_BYTES]))
            del self.buffer[:PART_BYTES]

    def _upload_part(self, body: bytes) -> None:
        client = self.store.client
        if self.upload_id is None:
            created = client.create_multipart_upload(Bucket=self.store.bucket, Key=self.key,
                                                     ContentType=self.content_type)
            self.upload_id = created["UploadId"]
        number = len(self.parts) + 1
        response = client.upload_part(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                      PartNumber=number, Body=body)
        self.parts.append({"ETag": response["ETag"], "PartNumber": number})

    def close(self) -> int:
        if self.upload_id is None:  # small object: one PUT
            self.store.put(self.key, bytes(self.buffer), content_type=self.content_type)
        else:
            if self.buffer:
                self._upload_part(bytes(self.buffer))
            self.store.client.complete_multipart_upload(
                Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
            )
        self.buffer = bytearray()
        return self.size

    def abort(self) -> None:
        self.buffer = bytearray()
        if self.upload_id is not None:
            # On failure a bucket lifecycle rule cleans the stale upload; nothing else refers to it.
            with contextlib.suppress(client_error()):
                self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.key,
                                                         UploadId=self.upload_id)


class _LocalWriter:
    def __init__(self, store: LocalObjectStore, key: str) -> None:
        self.path: Path = store._path(key)  # validates the key against the store's root
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "wb")
        self.size = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)

    def close(self) -> int:
        self.file.close()
        os.replace(self.tmp, self.path)  # readers never see half an object
        return self.size

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class _BufferedWriter:
    """Any other ObjectStore: whole object in memory (only used by stores without streaming)."""

    def __init__(self, store: ObjectStore, key: str, content_type: str) -> None:
        self.store, self.key, self.content_type = store, key, content_type
        self.buffer = bytearray()

    def write(self, data: bytes) -> None:
        self.buffer += data

    def close(self) -> int:
        self.store.put(self.key, bytes(self.buffer), content_type=self.content_type)
        return len(self.buffer)

    def abort(self) -> None:
        self.buffer = bytearray()


def open_writer(store: ObjectStore, key: str, content_type: str = "application/octet-stream") -> ObjectWriter:
    if isinstance(store, S3ObjectStore):
        return _S3Writer(store, key, content_type)
    if isinstance(store, LocalObjectStore):
        return _LocalWriter(store, key)
    return _BufferedWriter(store, key, content_type)


def open_reader(store: ObjectStore, key: str, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
    """The object's bytes in pieces. Raises ObjectNotFound here, before the first piece, so an HTTP handler
    can still answer 404 instead of breaking a response it already started."""
    if isinstance(store, S3ObjectStore):
        try:
            response = store.client.get_object(Bucket=store.bucket, Key=key)
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(key) from None
            raise
        return _s3_chunks(response["Body"], chunk_bytes)
    if isinstance(store, LocalObjectStore):
        try:
            handle = store._path(key).open("rb")
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
        return _file_chunks(handle, chunk_bytes)
    return iter([store.get(key)])


def _s3_chunks(body: Any, chunk_bytes: int) -> Iterator[bytes]:
    try:
        yield from body.iter_chunks(chunk_bytes)
    finally:
        body.close()


def _file_chunks(handle: Any, chunk_bytes: int) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(chunk_bytes):
            yield chunk


class ChunkStream(io.RawIOBase):
    """A read-only file over an iterator of byte pieces (for tarfile and csv, which want a file)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.rest:
            piece = next(self.chunks, None)
            if piece is None:
                return 0
            self.rest = piece
        n = min(len(buffer), len(self.rest))
        buffer[:n] = self.rest[:n]
        self.rest = self.rest[n:]
        return n


class _S3RangeReader(io.RawIOBase):
    """A seekable read-only file over an S3 object, by ranged GETs (zipfile reads its directory at the end
    of the archive and then each member: no local copy of the archive needed)."""

    def __init__(self, store: S3ObjectStore, key: str, size: int) -> None:
        self.store, self.key, self.size, self.pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.size or len(buffer) == 0:
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        try:
            response = self.store.client.get_object(Bucket=self.store.bucket, Key=self.key,
                                                    Range=f"bytes={self.pos}-{end}")
        except client_error() as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise ObjectNotFound(self.key) from None
            raise
        data = response["Body"].read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def open_seekable(store: ObjectStore, key: str, size: int) -> io.BufferedReader:
    """A seekable, buffered binary file over an object of `size` bytes."""
    if isinstance(store, S3ObjectStore):
        return io.BufferedReader(_S3RangeReader(store, key, size), buffer_size=READ_CHUNK_BYTES)
    if isinstance(store, LocalObjectStore):
        try:
            return store._path(key).open("rb")
        except FileNotFoundError:
            raise ObjectNotFound(key) from None
    return io.BufferedReader(io.BytesIO(store.get(key)))


def file_key(file_id: str, tenant: str) -> str:
    return f"{tenant_prefix(tenant)}files/{file_id}"


def add_file(session: Session, *, file_id: str, key: str, size: int, filename: str, purpose: str,
             tenant: str, expires_after: ExpiresAfter | None = None) -> FileRecord:
    now = utcnow()
    record = FileRecord(id=file_id, tenant=tenant, object_key=key, size_bytes=size, filename=filename[:512],
                        purpose=purpose, status="processed", created_at=now,
                        expires_at=expires_after.expires_at(now) if expires_after is not None else None)
    session.add(record)
    session.flush()
    return record


def discard_files(db: Database, store: ObjectStore, tenant: str, file_ids: list[str]) -> None:
    """Delete files (rows, then objects) made for a request that then failed: nothing refers to them yet."""
    with db.session() as session:
        for file_id in file_ids:
            if (record := session.get(FileRecord, file_id)) is not None:
                session.delete(record)
    for file_id in file_ids:
        store.delete(file_key(file_id, tenant))


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_view(record: FileRecord) -> dict[str, Any]:
    """The OpenAI `file` object."""
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.size_bytes,
        "created_at": _ts(record.created_at),
        "expires_at": _ts(record.expires_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": record.status,
        "status_details": None,
    }
