"""Turning a validated request into a stored, queued job: shared by the API, `vlmq run` and ingestion.

Images are checked (format, pixels, integrity) and stored once under their content hash before the job row
is written, so a worker never meets an image the API would have refused.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from common import jobs
from common.batches import insert_ignoring_conflicts
from common.image_cache import ImageCache
from common.image_fetch import ImageFetchError, fetcher_for
from common.images import ImageError, inspect_image, parse_data_url
from common.models import DEFAULT_TENANT, ImageRecord, Job, utcnow
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


def store_image(session: Session, store: ObjectStore, data: bytes, settings: Settings) -> ImageRecord:
    """Validate and store an image once (content-addressed); returns its row."""
    if len(data) > settings.max_image_bytes:
        raise SubmissionError(
            f"image is {len(data)} bytes; the limit is {settings.max_image_bytes}", 413, "image_too_large"
        )
    sha256 = hashlib.sha256(data).hexdigest()
    existing = session.get(ImageRecord, sha256)
    if existing is not None:
        return existing
    try:
        info = inspect_image(
            data,
            max_pixels=settings.max_image_pixels,
            allowed_formats=tuple(settings.allowed_image_formats),
            max_frames=settings.max_image_frames,
        )
    except ImageError as exc:
        raise SubmissionError(str(exc), 400, "invalid_image") from None
    key = image_key(sha256)
    if not store.exists(key):
        store.put(key, data, content_type=f"image/{info.format.lower()}")
    values = {"id": sha256, "format": info.format, "width": info.width, "height": info.height,
              "size_bytes": info.size_bytes, "created_at": utcnow()}
    # INSERT .. ON CONFLICT DO NOTHING: one round trip, where a savepoint around an ORM flush took three.
    if insert_ignoring_conflicts(session, ImageRecord, [values], ["id"], returning=ImageRecord.id):
        return ImageRecord(**values)
    # Another request stored the same image a moment ago.
    return session.get(ImageRecord, sha256, populate_existing=True)  # type: ignore[return-value]


def _resolve_image(url: str, session: Session, store: ObjectStore, settings: Settings) -> str:
    match = IMAGE_ID_RE.match(url)
    if match:
        sha256 = match.group(1)
        if session.get(ImageRecord, sha256) is None:
            raise SubmissionError(f"unknown image id {url!r}: upload it with POST /v1/images first", 400,
                                  "unknown_image")
        return sha256
    if url.startswith("data:"):
        try:
            data = parse_data_url(url)
        except ImageError as exc:
            raise SubmissionError(str(exc), 400, "invalid_image") from None
        return store_image(session, store, data, settings).id
    if url[:8].lower().startswith(("http://", "https://")):
        if not settings.image_urls_enabled:
            raise SubmissionError("remote image URLs are not enabled on this server; send a data: URL or an "
                                  "uploaded image id (img_...)", 400, "image_url_not_allowed")
        try:
            data = fetcher_for(settings).fetch(url)
        except ImageFetchError as exc:
            raise SubmissionError(str(exc), 400, exc.code) from None
        return store_image(session, store, data, settings).id
    raise SubmissionError("image_url.url must be a data: URL or an uploaded image id (img_<sha256>)", 400,
                          "invalid_image")


def normalize_request(
    req: ChatCompletionRequest, session: Session, store: ObjectStore, settings: Settings,
    images: ImageCache | None = None,
) -> dict[str, Any]:
    """The job's stored request: messages with images replaced by content hashes, and sampling. With
    `images` (one ingestion run's cache), an image reference met before is not resolved again."""
    messages: list[dict[str, Any]] = []
    num_images = 0
    for message in req.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": [{"type": "text", "text": message.content}]})
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
                if images is None:
                    image_id = _resolve_image(url, session, store, settings)
                else:
                    image_id = images.resolve(url, lambda u=url: _resolve_image(u, session, store, settings))
                parts.append({"type": "image", "image_id": image_id})
        messages.append({"role": message.role, "content": parts})
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
        if existing is not None:
            return existing, False
    if isinstance(req, JobCreate):
        priority, metadata = req.priority, req.metadata
    model = resolve_model(req.model, settings)
    request = normalize_request(req, session, store, settings)
    if idempotency_key is None:
        # Nothing to race on (ids are random): no savepoint, which costs two round trips per job.
        job = jobs.create_job(
            session, model=model, request=request, priority=priority, max_attempts=settings.max_attempts,
            metadata=metadata, batch_id=batch_id, custom_id=custom_id, tenant=tenant, dispatched=dispatched,
        )
        return job, True
    try:
        with session.begin_nested():
            job = jobs.create_job(
                session, model=model, request=request, priority=priority, max_attempts=settings.max_attempts,
                metadata=metadata, idempotency_key=idempotency_key, batch_id=batch_id, custom_id=custom_id,
                tenant=tenant, dispatched=dispatched,
            )
    except IntegrityError:
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is None:
            raise
        return existing, False
    return job, True


def _by_idempotency_key(session: Session, tenant: str, key: str | None) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))
