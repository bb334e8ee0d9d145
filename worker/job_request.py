"""A claimed job's stored request -> the engine's `GenerationRequest`: its images fetched and decoded.

Used in the job's own thread and in the prepare pool's processes (worker/prepare_pool.py), so both decode with
the same limits and refuse the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.images import decode_image
from common.settings import Settings
from common.storage import image_key
from worker.generation import GenerationRequest, SamplingParams


def has_images(request: dict[str, Any]) -> bool:
    return any(part["type"] == "image" for message in request["messages"] for part in message["content"])


def generation_request(job_id: str, request: dict[str, Any], priority: int, settings: Settings,
                       fetch: Callable[[str], bytes], tenant: str) -> GenerationRequest:
    """`request`: the normalised chat request of common/submission.py; `fetch`: an object's bytes by key;
    `tenant`: the job's, whose requests alone share cached prompt blocks and image embeddings."""
    images = []
    messages: list[dict[str, Any]] = []
    for message in request["messages"]:
        parts = []
        for part in message["content"]:
            if part["type"] == "image":
                data = fetch(image_key(part["image_id"]))
                images.append(decode_image(data, max_pixels=settings.max_image_pixels,
                                           allowed_formats=tuple(settings.allowed_image_formats),
                                           max_frames=settings.max_image_frames))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": message["role"], "content": parts})
    s = request["sampling"]
    sampling = SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                              top_k=s.get("top_k", 0), seed=s["seed"], stop=list(s["stop"]))
    return GenerationRequest(request_id=job_id, messages=messages, images=images, sampling=sampling,
                             priority=priority, cache_salt=tenant)
