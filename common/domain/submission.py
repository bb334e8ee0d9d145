"""Turning a validated request into a stored, queued job: shared by the API, `vlmq run` and ingestion.

Images are checked (format, pixels, integrity) and stored once under their content hash before the job row
is written (common/images/refs.py, common/images/stored.py), so a worker never meets an image the API would have
refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, Protocol

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from common.domain import jobs
from common.domain.models import DEFAULT_TENANT, Job
from common.domain.prompt_size import check_prompt_size
from common.domain.schemas import ChatCompletionRequest, ImagePart, JobCreate, TextPart
from common.domain.submission_error import SubmissionError
from common.images.pack import ImagePack, without_locations
from common.images.refs import ResolvedImage, known_image, resolve_image
from common.infra.settings import Settings
from common.infra.storage import ObjectStore

__all__ = ["ImageResolver", "SubmissionError", "job_fields", "needs_session", "normalize_request", "resolve_model",
           "submit_job"]


class ImageResolver(Protocol):
    """Where normalize_request resolves an image reference through: an ingestion run's ImageCache
    (common/images/cache.py), or a window of its lines (worker/batches/image_window.py). `compute` resolves it
    alone (common/images/refs.py resolve_image)."""

    def resolve(self, url: str, compute: Callable[[], ResolvedImage]) -> ResolvedImage: ...


def needs_session(req: ChatCompletionRequest, tenant: str = DEFAULT_TENANT) -> bool:
    """Whether normalising `req` has images to look up or store (not only the tenant's ids known here)."""
    return any(isinstance(part, ImagePart) and known_image(part.image_url.url, tenant) is None
               for m in req.messages if not isinstance(m.content, str) for part in m.content)


def normalize_request(
    req: ChatCompletionRequest, session: Session | None, store: ObjectStore, settings: Settings,
    images: ImageResolver | None = None, tenant: str = DEFAULT_TENANT,
    model_files: str | Literal["served"] | None = "served", pack: ImagePack | None = None,
) -> dict[str, Any]:
    """The job's stored request: messages with images replaced by content hashes, and sampling. Images named
    by id must be the tenant's own. With `images` (one ingestion run's cache, so one tenant's), an image
    reference met before is not resolved again. Only a request with images to resolve needs a `session`
    (see needs_session); with `pack`, new images' bytes go into it (common/images/pack.py). The prompt is
    measured against the context of the model whose files are at `model_files` ("served": settings.model;
    None: not known here, see common/domain/prompt_size.py)."""
    check_prompt_size(req, settings, settings.model if model_files == "served" else model_files)
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
                resolved = known_image(url, tenant)
                if resolved is None:
                    if session is None:
                        raise ValueError("a request with images to resolve is normalised in a session")
                    resolve = partial(resolve_image, url, session, store, settings, tenant, pack)
                    resolved = resolve() if images is None else images.resolve(url, resolve)
                pixels += resolved.pixels
                if pixels > settings.max_job_pixels:
                    raise SubmissionError(f"the job's images hold over {settings.max_job_pixels:,} pixels in all "
                                          "(width x height, summed), this server's limit", 400, "too_many_pixels")
                parts.append(resolved.as_part())
        messages.append({"role": role, "content": parts})
    # None: the worker's default (the model's generation_config max_new_tokens, else VLMQ_DEFAULT_MAX_TOKENS).
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None and max_tokens > settings.max_tokens_limit:
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
) -> jobs.NewJob:
    """The job `req` asks for, checked and normalised (see normalize_request)."""
    if isinstance(req, JobCreate):
        # A null priority was read as the default already (ChatCompletionRequest._null_means_default).
        priority, metadata = priority if req.priority is None else req.priority, req.metadata
    return jobs.NewJob(model=resolve_model(req.model, settings),
                       request=normalize_request(req, session, store, settings, tenant=tenant),
                       priority=priority, max_attempts=settings.max_attempts, metadata=metadata,
                       batch_id=batch_id, custom_id=custom_id, tenant=tenant, dispatched=dispatched)


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
        return jobs.add_job(session, fields), True
    try:
        with session.begin_nested():
            job = jobs.add_job(session, fields, idempotency_key)
    except IntegrityError:
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is None:
            raise
        return _same_request(existing, fields, idempotency_key), False
    return job, True


def _same_request(job: Job, fields: jobs.NewJob, key: str) -> Job:
    """`job` if `fields` ask for what it was created with: a key reused for another request is a client bug
    that answering with the old job would hide."""
    asked = json.loads(json.dumps([fields.model, without_locations(fields.request), fields.priority,
                                   fields.metadata]))
    if asked != [job.model, without_locations(job.request), job.priority, job.metadata_]:
        raise SubmissionError(f"Idempotency-Key {key[:80]!r} was already used for a different request (job "
                              f"{job.id}); use a new key for a new request", 422, "idempotency_key_reused")
    return job


def _by_idempotency_key(session: Session, tenant: str, key: str | None) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))
