"""New images stored together, back to back in one object (a pack), instead of one object each.

A batch of a million rows with a picture each would otherwise cost a million PUTs at ingestion and a million
GETs at the workers, each a round trip and a pass through the S3 client and server. Ingestion writes the new
images of each of its transactions as one pack; each image's SQL row and each job's stored request say where
its bytes lie (key, offset, size), so a worker reads the images of the rows it holds with one ranged GET per
pack (worker/jobs/image_reader.py). Images stay content-addressed: an image's id is its sha256 wherever its
bytes lie, and any stored copy serves.

A pack is written before the transaction that records its images commits, as a lone image is: a crash between
the two leaves an object nothing names, never a row naming bytes that are not there. Packs are never deleted,
as images are not.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from common.infra.settings import Settings
from common.infra.storage import ObjectStore

PACK_PREFIX = "packs/"


@dataclass(frozen=True)
class PackedImage:
    """Where an image's bytes lie in a pack."""

    key: str
    offset: int
    size: int

    def as_part_fields(self) -> dict[str, Any]:
        """The fields a stored request's image part carries (common/domain/submission.py)."""
        return {"pack": self.key, "offset": self.offset, "size": self.size}

    @classmethod
    def of_part(cls, part: dict[str, Any]) -> PackedImage | None:
        """Where a stored request's image part says its bytes lie; None for an image stored on its own."""
        key = part.get("pack")
        return None if key is None else cls(key, int(part["offset"]), int(part["size"]))


PART_LOCATION_FIELDS = ("pack", "offset", "size")


def without_locations(request: dict[str, Any]) -> dict[str, Any]:
    """A stored request with its image parts reduced to the image ids: where a copy of the bytes lies is the
    store's business, not part of what was asked (two requests for the same images are the same request, one
    resolved to a lone object and the other to some tenant's pack)."""
    return {**request, "messages": [
        {**message, "content": [
            {k: v for k, v in part.items() if k not in PART_LOCATION_FIELDS} if part.get("type") == "image" else part
            for part in message["content"]]}
        for message in request["messages"]]}


class ImagePack:
    """The new images of one transaction, written as one object by `flush`, or as several when they exceed
    `max_bytes` (an image larger than that is a pack of its own). Not thread-safe: one per ingestion run."""

    def __init__(self, store: ObjectStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self._key: str | None = None
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, data: bytes) -> PackedImage:
        """Where `data` will lie once flushed: flush before the transaction that records it commits."""
        if self._parts and self._size + len(data) > self.max_bytes:
            self.flush()
        if self._key is None:
            self._key = f"{PACK_PREFIX}{uuid.uuid4().hex}"
        packed = PackedImage(self._key, self._size, len(data))
        self._parts.append(data)
        self._size += len(data)
        return packed

    def flush(self) -> None:
        """Write what was added since the last flush, if anything; the next add starts a new pack."""
        if self._key is not None and self._parts:
            self.store.put(self._key, b"".join(self._parts))
        self._key, self._parts, self._size = None, [], 0

    @classmethod
    def for_settings(cls, store: ObjectStore, settings: Settings) -> ImagePack | None:
        """An ingestion's pack, sized by VLMQ_IMAGE_PACK_BYTES; None where that is 0 (an object per image)."""
        return cls(store, settings.image_pack_bytes) if settings.image_pack_bytes else None
