"""Turning a validated request into a stored, queued job: shared by the API, `vlmq run` and ingestion.

Images are checked (format, pixels, integrity) and stored once under their content hash before the job row
is written, so a worker never meets an image the API would have refused.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, event, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from common import jobs
from common.batches import insert_ignoring_conflicts
from common.image_cache import ImageCache
from common.image_fetch import ImageFetchError, fetcher_for
from common.images import ImageError, inspect_image, parse_data_url
from common.models import DEFAULT_TENANT, ImageOwner, ImageRecord, Job, utcnow
from common.schemas import ChatCompletionRequest, ImagePart, JobCreate, TextPart
from common.settings import Settings
from common.storage import ObjectStore, image_key

IMAGE_ID_RE = re.compile(r"^(?:vlmq://)?img_([0-9a-f]{64})$")


class SubmissionError(ValueError):
    """A request we refuse; `status_code` is the HTTP status the API answers with."""

    def __init__(self, message: str, status_code: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code


def image_public_id(sha256: str) -> str:
    return f"img_{sha256}"


@dataclass(frozen=True)
class StoredImage:
    """An image as one tenant sees it: its row, but created_at when this tenant first stored it."""

    id: str  # sha256 hex of the bytes
    format: str
    width: int
    height: int
    size_bytes: int
    created_at: datetime


# Built once: a fresh select() per lookup cost more Python than the round trip (bench/ingest.py, new images).
_OWNED_IMAGE = (
    select(ImageRecord.id, ImageRecord.format, ImageRecord.width, ImageRecord.height, ImageRecord.size_bytes,
           ImageOwner.created_at)
    .join(ImageOwner, ImageOwner.image_id == ImageRecord.id)
    .where(ImageOwner.tenant == bindparam("tenant"), ImageRecord.id == bindparam("sha256")))


def owned_image(session: Session, tenant: str, sha256: str) -> StoredImage | None:
    """The image as `tenant` sees it, if it stored it; None for an image stored only by others, as for none at
    all. Its `created_at` is when this tenant first stored it: the image row's own would tell when anyone did."""
    row = session.execute(_OWNED_IMAGE, {"tenant": tenant, "sha256": sha256}).first()
    return None if row is None else StoredImage(*row)


def store_image(session: Session, store: ObjectStore, data: bytes, settings: Settings,
                tenant: str = DEFAULT_TENANT) -> StoredImage:
    """Validate and store an image once (content-addressed), owned by `tenant` from then on; returns it as
    `tenant` sees it (owned_image).

    Only the tenant's own images take the short path. One that another tenant stored goes the whole way
    (checked, written again: the same bytes under the same key) and is answered from what this request
    computed, as a new image is, so neither the answer nor its timing tells a tenant that somebody else sent
    these bytes."""
    if len(data) > settings.max_image_bytes:
        raise SubmissionError(
            f"image is {len(data)} bytes; the limit is {settings.max_image_bytes}", 413, "image_too_large"
        )
    sha256 = hashlib.sha256(data).hexdigest()
    existing = owned_image(session, tenant, sha256)
    if existing is not None:
        return existing
    try:
        info = inspect_image(
            data,
            max_pixels=settings.max_image_pixels,
            allowed_formats=tuple(settings.allowed_image_formats),
            max_frames=settings.max_image_frames,
            check=settings.image_check,
        )
    except ImageError as exc:
        raise SubmissionError(str(exc), 400, "invalid_image") from None
    # No HEAD first: the key is the content's hash, so a PUT over an object left by an earlier attempt writes
    # the same bytes, and a new image (the case that reaches here) costs one S3 round trip instead of two.
    store.put(image_key(sha256), data, content_type=f"image/{info.format.lower()}")
    values = {"id": sha256, "format": info.format, "width": info.width, "height": info.height,
              "size_bytes": info.size_bytes, "created_at": utcnow()}
    if _insert_image(session, values, tenant):
        return StoredImage(**values)
    # Another request of this tenant's stored it a moment ago.
    return owned_image(session, tenant, sha256)  # type: ignore[return-value]


# Both rows in one round trip (a second INSERT cost ingestion a fifth of its rows/s on new images,
# bench/ingest.py). The image row may be another tenant's already: the same bytes, so the same values.
_PG_INSERT_IMAGE = text(
    "WITH image AS (INSERT INTO images (id, format, width, height, size_bytes, created_at) "
    "VALUES (:id, :format, :width, :height, :size_bytes, :created_at) ON CONFLICT (id) DO NOTHING) "
    "INSERT INTO image_owners (tenant, image_id, created_at) VALUES (:tenant, :id, :created_at) "
    "ON CONFLICT (tenant, image_id) DO NOTHING RETURNING tenant")


def _insert_image(session: Session, values: dict[str, Any], tenant: str) -> bool:
    """INSERT .. ON CONFLICT DO NOTHING the image's row and its owner's; whether the owner's was new."""
    if session.get_bind().dialect.name == "postgresql":
        return session.execute(_PG_INSERT_IMAGE, {**values, "tenant": tenant}).first() is not None
    insert_ignoring_conflicts(session, ImageRecord, [values], ["id"])
    owner = {"tenant": tenant, "image_id": values["id"], "created_at": values["created_at"]}
    return bool(insert_ignoring_conflicts(session, ImageOwner, [owner], ["tenant", "image_id"],
                                          returning=ImageOwner.tenant))


@dataclass(frozen=True)
class ResolvedImage:
    sha256: str
    pixels: int  # width x height: a job's images together may hold at most settings.max_job_pixels

    @classmethod
    def of(cls, record: StoredImage) -> ResolvedImage:
        return cls(record.id, record.width * record.height)


class KnownImages:
    """(tenant, image id) pairs this process has seen owned in SQL, with the image's pixels. Image and owner
    rows are never deleted, so once seen a pair stays valid, and a job naming the tenant's uploaded images
    needs no lookup (nor a session) after the first."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._pixels: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> int | None:
        """The image's pixels if the pair is known (now the most recently used), else None."""
        with self._lock:
            pixels = self._pixels.get(key)
            if pixels is not None:
                self._pixels.move_to_end(key)
            return pixels

    def add(self, key: tuple[str, str], pixels: int) -> None:
        with self._lock:
            self._pixels[key] = pixels
            self._pixels.move_to_end(key)
            while len(self._pixels) > self.capacity:
                self._pixels.popitem(last=False)


known_images = KnownImages()
# Pairs a session saw owned, remembered once its transaction commits: the read may have seen the session's own
# uncommitted rows (an image stored by an earlier part of the same request), which a rollback takes away.
_SEEN_OWNED = "vlmq_seen_owned_images"


@event.listens_for(Session, "after_commit")
def _remember_seen_owned(session: Session) -> None:
    for key, pixels in session.info.pop(_SEEN_OWNED, ()):
        known_images.add(key, pixels)


@event.listens_for(Session, "after_rollback")
def _forget_seen_owned(session: Session) -> None:
    session.info.pop(_SEEN_OWNED, None)


def _known_image(url: str, tenant: str) -> ResolvedImage | None:
    match = IMAGE_ID_RE.match(url)
    pixels = known_images.get((tenant, match.group(1))) if match else None
    return None if match is None or pixels is None else ResolvedImage(match.group(1), pixels)


def _resolve_image(url: str, session: Session, store: ObjectStore, settings: Settings, tenant: str
                   ) -> ResolvedImage:
    match = IMAGE_ID_RE.match(url)
    if match:
        record = owned_image(session, tenant, match.group(1))
        if record is None:
            raise SubmissionError(f"unknown image id {url!r}: upload it with POST /v1/images first", 400,
                                  "unknown_image")
        resolved = ResolvedImage.of(record)
        session.info.setdefault(_SEEN_OWNED, []).append(((tenant, resolved.sha256), resolved.pixels))
        return resolved
    if url.startswith("data:"):
        try:
            data = parse_data_url(url)
        except ImageError as exc:
            raise SubmissionError(str(exc), 400, "invalid_image") from None
        return ResolvedImage.of(store_image(session, store, data, settings, tenant))
    if url[:8].lower().startswith(("http://", "https://")):
        if not settings.image_urls_enabled:
            raise SubmissionError("remote image URLs are not enabled on this server; send a data: URL or an "
                                  "uploaded image id (img_...)", 400, "image_url_not_allowed")
        try:
            data = fetcher_for(settings).fetch(url)
        except ImageFetchError as exc:
            raise SubmissionError(str(exc), 400, exc.code) from None
        return ResolvedImage.of(store_image(session, store, data, settings, tenant))
    raise SubmissionError("image_url.url must be a data: URL or an uploaded image id (img_<sha256>)", 400,
                          "invalid_image")


def needs_session(req: ChatCompletionRequest, tenant: str = DEFAULT_TENANT) -> bool:
    """Whether normalising `req` has images to look up or store (not only the tenant's ids known here)."""
    return any(isinstance(part, ImagePart) and _known_image(part.image_url.url, tenant) is None
               for m in req.messages if not isinstance(m.content, str) for part in m.content)


def normalize_request(
    req: ChatCompletionRequest, session: Session | None, store: ObjectStore, settings: Settings,
    images: ImageCache[ResolvedImage] | None = None, tenant: str = DEFAULT_TENANT,
) -> dict[str, Any]:
    """The job's stored request: messages with images replaced by content hashes, and sampling. Images named
    by id must be the tenant's own. With `images` (one ingestion run's cache, so one tenant's), an image
    reference met before is not resolved again. Only a request with images to resolve needs a `session`
    (see needs_session)."""
    messages: list[dict[str, Any]] = []
    num_images = pixels = 0
    for message in req.messages:
        # OpenAI's newer name for the system message; chat templates know only "system".
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str):
            messages.append({"role": role, "content": [{"type": "text", "text": message.content}]})
            continue
        parts: list[dict[str, Any]] = []
        for part in message.content:
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                num_images += 1
                if num_images > settings.max_images_per_job:
                    raise SubmissionError(f"a job may carry at most {settings.max_images_per_job} images",
                                          400, "too_many_images")
                url = part.image_url.url
                resolved = _known_image(url, tenant)
                if resolved is None:
                    if session is None:
                        raise ValueError("a request with images to resolve is normalised in a session")
                    if images is None:
                        resolved = _resolve_image(url, session, store, settings, tenant)
                    else:
                        resolved = images.resolve(url, lambda u=url: _resolve_image(u, session, store, settings,
                                                                                    tenant))
                pixels += resolved.pixels
                if pixels > settings.max_job_pixels:
                    raise SubmissionError(f"the job's images hold over {settings.max_job_pixels:,} pixels in all "
                                          "(width x height, summed), this server's limit", 400, "too_many_pixels")
                parts.append({"type": "image", "image_id": resolved.sha256})
        messages.append({"role": role, "content": parts})
    max_tokens = req.max_completion_tokens or req.max_tokens or 256
    if max_tokens > settings.max_tokens_limit:
        raise SubmissionError(f"max_tokens {max_tokens} exceeds this server's limit of "
                              f"{settings.max_tokens_limit}", 400, "max_tokens_too_large")
    return {
        "messages": messages,
        "sampling": {
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "stop": req.stop_list,
        },
    }


def resolve_model(requested: str | None, settings: Settings) -> str:
    served = settings.served_model_name
    if not served:
        raise SubmissionError("this server has no model configured (set VLMQ_MODEL)", 503, "no_model")
    if requested and requested != served:
        raise SubmissionError(f"model {requested!r} is not served here; available: {served!r}", 404,
                              "model_not_found")
    return served


def job_fields(
    session: Session | None, store: ObjectStore, settings: Settings, req: ChatCompletionRequest, *,
    priority: int = 5, metadata: dict[str, Any] | None = None, tenant: str = DEFAULT_TENANT,
    batch_id: str | None = None, custom_id: str | None = None, dispatched: bool = True,
) -> dict[str, Any]:
    """common.jobs.new_job's arguments for `req`, checked and normalised (see normalize_request)."""
    if isinstance(req, JobCreate):
        priority, metadata = req.priority, req.metadata
    return {"model": resolve_model(req.model, settings),
            "request": normalize_request(req, session, store, settings, tenant=tenant),
            "priority": priority, "max_attempts": settings.max_attempts, "metadata": metadata,
            "batch_id": batch_id, "custom_id": custom_id, "tenant": tenant, "dispatched": dispatched}


def submit_job(
    session: Session,
    store: ObjectStore,
    settings: Settings,
    req: ChatCompletionRequest,
    *,
    priority: int = 5,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    batch_id: str | None = None,
    custom_id: str | None = None,
    tenant: str = DEFAULT_TENANT,
    dispatched: bool = True,
) -> tuple[Job, bool]:
    """Write a queued job; returns (job, created). With a known idempotency key, the tenant's earlier job."""
    if idempotency_key is not None:
        if len(idempotency_key) > 255 or not idempotency_key:
            raise SubmissionError("Idempotency-Key must be 1-255 characters", 400, "invalid_idempotency_key")
        existing = _by_idempotency_key(session, tenant, idempotency_key)
    fields = job_fields(session, store, settings, req, priority=priority, metadata=metadata, tenant=tenant,
                        batch_id=batch_id, custom_id=custom_id, dispatched=dispatched)
    if idempotency_key is not None and existing is not None:
        return _same_request(existing, fields, idempotency_key), False
    if idempotency_key is None:
        # Nothing to race on (ids are random): no savepoint, which costs two round trips per job.
        return jobs.create_job(session, **fields), True
    try:
        with session.begin_nested():
            job = jobs.create_job(session, idempotency_key=idempotency_key, **fields)
    except IntegrityError:
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is None:
            raise
        return _same_request(existing, fields, idempotency_key), False
    return job, True


def _same_request(job: Job, fields: dict[str, Any], key: str) -> Job:
    """`job` if `fields` ask for what it was created with: a key reused for another request is a client bug
    that answering with the old job would hide."""
    asked = json.loads(json.dumps([fields["model"], fields["request"], fields["priority"], fields["metadata"]]))
    if asked != [job.model, job.request, job.priority, job.metadata_]:
        raise SubmissionError(f"Idempotency-Key {key[:80]!r} was already used for a different request (job "
                              f"{job.id}); use a new key for a new request", 422, "idempotency_key_reused")
    return job


def _by_idempotency_key(session: Session, tenant: str, key: str | None) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))
