"""A request's image references (an uploaded image's id, a data: URL, a remote URL) resolved to stored images
of the request's tenant, with their sizes; ids seen owned are remembered by the process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from common.domain.submission_error import SubmissionError
from common.images.decode import ImageError, parse_data_url
from common.images.pack import ImagePack, PackedImage
from common.images.stored import IMAGE_ID_RE, StoredImage, owned_image, store_image
from common.infra.settings import Settings
from common.infra.storage import ObjectStore


@dataclass(frozen=True)
class ResolvedImage:
    sha256: str
    pixels: int  # width x height: a job's images together may hold at most settings.max_job_pixels
    pack: PackedImage | None = None  # where its bytes lie in a pack; None: under image_key(sha256)

    @classmethod
    def of(cls, record: StoredImage) -> ResolvedImage:
        return cls(record.id, record.width * record.height, record.pack)

    def as_part(self) -> dict[str, Any]:
        """The image's part in a stored request: its id, and where its bytes lie if in a pack."""
        part: dict[str, Any] = {"type": "image", "image_id": self.sha256}
        if self.pack is not None:
            part.update(self.pack.as_part_fields())
        return part


class KnownImages:
    """(tenant, image id) pairs this process has seen owned in SQL, with what the image resolved to. Image and
    owner rows are never deleted, nor the objects and packs they name, so once seen a pair stays valid, and a
    job naming the tenant's uploaded images needs no lookup (nor a session) after the first."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._resolved: OrderedDict[tuple[str, str], ResolvedImage] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> ResolvedImage | None:
        """The image if the pair is known (now the most recently used), else None."""
        with self._lock:
            resolved = self._resolved.get(key)
            if resolved is not None:
                self._resolved.move_to_end(key)
            return resolved

    def add(self, key: tuple[str, str], resolved: ResolvedImage) -> None:
        with self._lock:
            self._resolved[key] = resolved
            self._resolved.move_to_end(key)
            while len(self._resolved) > self.capacity:
                self._resolved.popitem(last=False)


known_images = KnownImages()
# Pairs a session saw owned, remembered once its transaction commits: the read may have seen the session's own
# uncommitted rows (an image stored by an earlier part of the same request), which a rollback takes away.
_SEEN_OWNED = "vlmq_seen_owned_images"


@event.listens_for(Session, "after_commit")
def _remember_seen_owned(session: Session) -> None:
    for key, resolved in session.info.pop(_SEEN_OWNED, ()):
        known_images.add(key, resolved)


@event.listens_for(Session, "after_rollback")
def _forget_seen_owned(session: Session) -> None:
    session.info.pop(_SEEN_OWNED, None)


def known_image(url: str, tenant: str) -> ResolvedImage | None:
    match = IMAGE_ID_RE.match(url)
    return known_images.get((tenant, match.group(1))) if match else None


def resolve_image(url: str, session: Session, store: ObjectStore, settings: Settings, tenant: str,
                  pack: ImagePack | None = None) -> ResolvedImage:
    """`pack`: where new images' bytes go (see store_image); None: objects of their own."""
    match = IMAGE_ID_RE.match(url)
    if match:
        record = owned_image(session, tenant, match.group(1))
        if record is None:
            raise SubmissionError(f"unknown image id {url!r}: upload it with POST /v1/images first", 400,
                                  "unknown_image")
        resolved = ResolvedImage.of(record)
        session.info.setdefault(_SEEN_OWNED, []).append(((tenant, resolved.sha256), resolved))
        return resolved
    if url.startswith("data:"):
        try:
            data = parse_data_url(url)
        except ImageError as exc:
            raise SubmissionError(str(exc), 400, "invalid_image") from None
        return ResolvedImage.of(store_image(session, store, data, settings, tenant, pack))
    if url[:8].lower().startswith(("http://", "https://")):
        if not settings.image_urls_enabled:
            raise SubmissionError("remote image URLs are not enabled on this server; send a data: URL or an "
                                  "uploaded image id (img_...)", 400, "image_url_not_allowed")
        from common.images.fetch import ImageFetchError, fetcher_for  # httpx: imported by those who fetch

        try:
            data = fetcher_for(settings).fetch(url)
        except ImageFetchError as exc:
            raise SubmissionError(str(exc), 400, exc.code) from None
        return ResolvedImage.of(store_image(session, store, data, settings, tenant, pack))
    raise SubmissionError("image_url.url must be a data: URL or an uploaded image id (img_<sha256>)", 400,
                          "invalid_image")
