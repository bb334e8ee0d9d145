"""A job's stored images read back from object storage: a lone image by its key, a packed one by its byte range
(common/images/pack.py), and the packed images of many rows with one ranged GET per stretch of a pack.

The rows of one run_job message were ingested together, so their new images lie side by side in one pack: the
chunk runner reads them all with one request where a request each would cost a round trip and a pass through
the S3 client and server per image.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.images.pack import PackedImage
from common.infra.storage import ObjectNotFound, ObjectStore, image_key

# Bytes between two wanted images of one pack that are read along rather than spent on a second request.
MERGE_GAP_BYTES = 1 << 20


@dataclass(frozen=True)
class ImageRef:
    """Where a stored request's image part says the image's bytes lie."""

    sha256: str
    pack: PackedImage | None  # None: an object of its own, under image_key(sha256)


def image_refs(request: dict[str, Any]) -> list[ImageRef]:
    """The images of a stored request (common/domain/submission.py), in the order of its image parts."""
    return [ImageRef(part["image_id"], PackedImage.of_part(part)) for message in request["messages"]
            for part in message["content"] if part["type"] == "image"]


class ImageReader:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def read(self, ref: ImageRef) -> bytes:
        """The image's bytes; raises ObjectNotFound when they are not where the reference says."""
        if ref.pack is None:
            return self.store.get(image_key(ref.sha256))
        return _checked(ref, self._range(ref.pack.key, ref.pack.offset, ref.pack.size))

    def read_many(self, refs: Iterable[ImageRef]) -> dict[ImageRef, bytes]:
        """The bytes of each packed image among `refs`, read with one ranged GET per stretch of a pack whose
        wanted images lie at most MERGE_GAP_BYTES apart. Lone images are left to `read`."""
        by_pack: dict[str, dict[ImageRef, PackedImage]] = defaultdict(dict)
        for ref in refs:
            if ref.pack is not None:
                by_pack[ref.pack.key][ref] = ref.pack
        found: dict[ImageRef, bytes] = {}
        for key, wanted in by_pack.items():
            for start, end, stretch in _stretches(wanted):
                data = self._range(key, start, end - start)
                for ref, at in stretch:
                    found[ref] = _checked(ref, data[at.offset - start:at.offset - start + at.size])
        return found

    def _range(self, key: str, start: int, size: int) -> bytes:
        """Bytes start..start+size of a pack. A server that ignored the range sent the whole object; one that
        sent less fails the read as a transient fault (the job is retried), never as a missing image."""
        data = self.store.get_range(key, start, size)
        if len(data) > size:
            data = data[start:start + size]
        if len(data) != size:
            raise OSError(f"{key}: read {len(data)} of the {size} bytes from {start}")
        return data


def _stretches(wanted: dict[ImageRef, PackedImage]) -> list[tuple[int, int, list[tuple[ImageRef, PackedImage]]]]:
    """(start, end, refs) of the wanted images of one pack, in order of offset, grouped where each starts at
    most MERGE_GAP_BYTES past the end of its group so far."""
    stretches: list[tuple[int, int, list[tuple[ImageRef, PackedImage]]]] = []
    for ref, at in sorted(wanted.items(), key=lambda item: item[1].offset):
        if stretches and at.offset - stretches[-1][1] <= MERGE_GAP_BYTES:
            start, end, group = stretches[-1]
            group.append((ref, at))
            stretches[-1] = (start, max(end, at.offset + at.size), group)
        else:
            stretches.append((at.offset, at.offset + at.size, [(ref, at)]))
    return stretches


def _checked(ref: ImageRef, data: bytes) -> bytes:
    """A packed image's bytes, refused unless they hash to its id: a pack cut short or misread must not feed
    the model another image's pixels."""
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        assert ref.pack is not None
        raise ObjectNotFound(f"{ref.pack.key} (bytes {ref.pack.offset}+{ref.pack.size} of image {ref.sha256})")
    return data
