"""A claimed job's stored request -> the engine's `GenerationRequest`: its images fetched and decoded.

Used in the job's own thread and in the prepare pool's processes (worker/jobs/prepare_pool.py), so both decode with
the same limits and refuse the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from common.images.decode import decode_image, image_pixels
from common.infra.settings import Settings
from worker.inference.generation import GenerationRequest, InputError, SamplingParams
from worker.jobs.image_reader import ImageRef, image_refs


@dataclass(frozen=True)
class JobImages:
    """A job's images as stored (compressed), in the order of its image parts, and their pixels in all."""

    data: list[bytes]
    pixels: int


NO_IMAGES = JobImages([], 0)  # a text-only job's


def has_images(request: dict[str, Any]) -> bool:
    return any(part["type"] == "image" for message in request["messages"] for part in message["content"])


def fetch_images(request: dict[str, Any], settings: Settings, fetch: Callable[[ImageRef], bytes],
                 fetched: Mapping[ImageRef, bytes] | None = None) -> JobImages:
    """The job's images, taken from `fetched` (read already, with a chunk's others) or else fetched (`fetch`:
    an image's bytes, worker/jobs/image_reader.py), and sized from their headers; raises InputError when
    together they exceed `settings.max_job_pixels`, before any is decoded."""
    fetched = fetched or {}
    data = [fetched.get(ref) or fetch(ref) for ref in image_refs(request)]
    formats = tuple(settings.allowed_image_formats)
    pixels = sum(image_pixels(d, max_pixels=settings.max_image_pixels, allowed_formats=formats) for d in data)
    if pixels > settings.max_job_pixels:
        raise InputError(f"the job's {len(data)} images hold {pixels:,} pixels in all; the limit is "
                         f"{settings.max_job_pixels:,} (VLMQ_MAX_JOB_PIXELS)")
    return JobImages(data, pixels)


def generation_request(job_id: str, request: dict[str, Any], priority: int, settings: Settings,
                       images: JobImages, tenant: str) -> GenerationRequest:
    """`request`: the normalised chat request of common/domain/submission.py; `images`: its fetch_images; `tenant`: the
    job's, whose requests alone share cached prompt blocks and image embeddings."""
    decoded = iter(images.data)
    pictures = []
    messages: list[dict[str, Any]] = []
    for message in request["messages"]:
        parts = []
        for part in message["content"]:
            if part["type"] == "image":
                pictures.append(decode_image(next(decoded), max_pixels=settings.max_image_pixels,
                                             allowed_formats=tuple(settings.allowed_image_formats),
                                             max_frames=settings.max_image_frames))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": message["role"], "content": parts})
    s = request["sampling"]
    # No max_tokens in the request: the worker's default (worker/inference/model_loader.py default_max_tokens).
    sampling = SamplingParams(max_tokens=s["max_tokens"] or settings.default_max_tokens,
                              temperature=s["temperature"], top_p=s["top_p"], top_k=s.get("top_k", 0),
                              seed=s["seed"], stop=list(s["stop"]))
    return GenerationRequest(request_id=job_id, messages=messages, images=pictures, sampling=sampling,
                             priority=priority, cache_salt=tenant)
