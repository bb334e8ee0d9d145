"""SQLAlchemy tables. Only common.domain.jobs changes a job's status."""

from __future__ import annotations

import enum
import os
import time
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, DateTime, Index, Integer, String, Table, Text, TypeDecorator
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on every backend (SQLite drops the zone on the way in)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# Postgres text cannot hold NUL, which a model can generate (a byte-level token 0x00). U+E000 (private use)
# escapes: itself as U+E000 U+E001, NUL as U+E000 U+E002, so every string round-trips on every backend.
_ESC, _ESC_ESC, _ESC_NUL = "\ue000", "\ue000\ue001", "\ue000\ue002"
_UNESCAPE = {"\ue001": _ESC, "\ue002": "\x00"}


class NulSafeText(TypeDecorator[str]):
    """Text that stores any Python string, NUL included."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        if value is None or (_ESC not in value and "\x00" not in value):
            return value
        return value.replace(_ESC, _ESC_ESC).replace("\x00", _ESC_NUL)

    def process_result_value(self, value: str | None, dialect: Any) -> str | None:
        if value is None or _ESC not in value:
            return value
        out, i = [], 0
        while (j := value.find(_ESC, i)) != -1:
            out.append(value[i:j])
            out.append(_UNESCAPE.get(value[j + 1:j + 2], value[j:j + 2]))
            i = j + 2
        out.append(value[i:])
        return "".join(out)


def new_file_id() -> str:
    """OpenAI spells file ids `file-...`; ours are time-ordered like every other id."""
    return f"file-{int(time.time() * 1000):012x}{os.urandom(10).hex()}"


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """Time-ordered id (ms timestamp + 80 random bits) so that ORDER BY id is creation order."""
    return f"{prefix}_{int(time.time() * 1000):012x}{os.urandom(10).hex()}"


# Who owns rows when auth is off (embedded mode), and the tenant of rows written before tenants existed.
DEFAULT_TENANT = "default"


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DEAD, JobStatus.CANCELLED})


class Base(DeclarativeBase):
    # Every model here maps one Table (DeclarativeBase types it as any FromClause, which has no update()).
    __table__: ClassVar[Table]


class ImageRecord(Base):
    """An image stored once in object storage: under images/<sha256>, or inside a pack (common/images/pack.py)."""

    __tablename__ = "images"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of the raw bytes
    format: Mapped[str] = mapped_column(String(16))
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The pack its bytes lie in and where, since size_bytes long; NULL: an object of its own.
    pack_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    pack_offset: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class ImageOwner(Base):
    """A tenant that stored an image (by upload, data: URL, remote URL or archive). Images are stored once for
    everyone, but a tenant may see or name by id only the images it stored itself: otherwise anyone holding an
    image's bytes could learn whether another tenant had sent it."""

    __tablename__ = "image_owners"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    image_id: Mapped[str] = mapped_column(String(64), primary_key=True)  # images.id
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_status_lease_until", "status", "lease_until"),
        Index("ix_jobs_batch_id_status", "batch_id", "status"),
        # A running batch's recent completion rate (its ETA) is a range of this index.
        Index("ix_jobs_batch_id_finished_at", "batch_id", "finished_at"),
        # One job per custom_id within a batch: ingestion detects duplicates across chunks with
        # INSERT .. ON CONFLICT DO NOTHING instead of a set of every id seen (bounded memory).
        Index("ux_jobs_batch_id_custom_id", "batch_id", "custom_id", unique=True),
        # Fair dispatch (common/broker/dispatch.py): a tenant's jobs of one model in the broker or running, and the
        # next ones to send, are both ranges of this index.
        Index("ix_jobs_dispatch", "tenant", "model", "status", "dispatched_at", "id"),
        # An Idempotency-Key is the client's and only means something within its tenant.
        Index("ux_jobs_tenant_idempotency_key", "tenant", "idempotency_key", unique=True),
    )

    id: Mapped[str] = mapped_column(String(48), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT)
    status: Mapped[str] = mapped_column(String(16), index=True, default=JobStatus.QUEUED)
    model: Mapped[str] = mapped_column(String(255))
    priority: Mapped[int] = mapped_column(Integer, default=5)
    # Normalised chat request: messages with image parts as {"type": "image", "image_id": sha256} (and, for an
    # image in a pack, "pack", "offset", "size": common/images/pack.py), sampling.
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    batch_id: Mapped[str | None] = mapped_column(String(48), nullable=True)
    custom_id: Mapped[str | None] = mapped_column(String(512), nullable=True)
    line: Mapped[int | None] = mapped_column(Integer, nullable=True)  # of the batch input file it came from

    # When a run_job message was last sent for it; NULL while it waits in SQL for its tenant's turn.
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    result_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    result_text: Mapped[str | None] = mapped_column(NulSafeText, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(NulSafeText, nullable=True)


class FileRecord(Base):
    """A file of the OpenAI Files API: a batch input upload or a batch's output/error JSONL."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(48), primary_key=True)  # file-...
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    object_key: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))  # batch (uploads) or batch_output (what we write)
    status: Mapped[str] = mapped_column(String(16), default="processed")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True, index=True)


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


BATCH_FINAL_STATUSES = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class Batch(Base):
    """An OpenAI batch. Its jobs carry batch_id; counts are live while it runs and frozen once it ends."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(48), primary_key=True)  # batch_...
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default=BatchStatus.VALIDATING)
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    input_file_id: Mapped[str] = mapped_column(String(48))
    model: Mapped[str] = mapped_column(String(255))  # the served model at creation: decides the job queue
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)  # why it failed
    output_file_id: Mapped[str | None] = mapped_column(String(48), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(48), nullable=True)
    # `output_expires_after.seconds`: the output and error files expire this long after they are written.
    output_expires_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Native datasets (a vlmq extension): a zip/tar of images the input lines name by relative path. Its
    # members are stored and indexed (batch_images) once, before the lines are read.
    images_file_id: Mapped[str | None] = mapped_column(String(48), nullable=True)
    images_indexed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    images_root: Mapped[str | None] = mapped_column(String(255), nullable=True)  # the archive's one top folder

    # Ingestion progress, committed with each chunk of job rows: a redelivered ingest task resumes after
    # `ingested_lines` (a physical line number of the input file) instead of inserting twice.
    ingested_lines: Mapped[int] = mapped_column(Integer, default=0)
    total_requests: Mapped[int] = mapped_column(Integer, default=0)  # non-blank lines read so far
    refused_requests: Mapped[int] = mapped_column(Integer, default=0)  # lines refused at ingestion
    # Frozen at finalization; while the batch runs they are counted from its jobs.
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    output_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class BatchLineError(Base):
    """A line of a batch input file refused at ingestion; written in the same transaction as its chunk."""

    __tablename__ = "batch_line_errors"

    batch_id: Mapped[str] = mapped_column(String(48), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str | None] = mapped_column(String(512), nullable=True)
    code: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    param: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the line's field at fault


class BatchImage(Base):
    """A member of a batch's image archive: its relative path -> the stored image (or why it is unusable)."""

    __tablename__ = "batch_images"

    batch_id: Mapped[str] = mapped_column(String(48), primary_key=True)
    path_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of path: any length indexes
    path: Mapped[str] = mapped_column(Text)
    image_id: Mapped[str | None] = mapped_column(String(64), nullable=True)  # sha256 of the image bytes
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class ApiKey(Base):
    """A tenant's API key. Only a hash of the secret is kept; the key itself is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(48), primary_key=True)  # key_...: the public part of the key
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
