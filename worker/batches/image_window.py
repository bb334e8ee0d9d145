"""A window of an ingestion's input lines, whose data: URL images are looked up and stored with a constant
number of SQL round trips, not two per image.

store_image (common/images/stored.py) asks SQL whether the tenant stored an image already, then inserts the rows
of a new one: two round trips per image, most of the ingestion of a batch of distinct pictures. Here the lines
of a window are parsed first; their data: URLs the run has not met are decoded and hashed once each, and one
SELECT finds those the tenant owns. Each line is then normalised as before, through `WindowImages.resolve`: a
new image is inspected and added to the pack when a line first reaches it, exactly where store_image would have
done it, and the rows of all of them are written by one INSERT once the window's lines are done. So every line
is answered as store_image would answer it, with the same refusals, and only the images that a line reached are
stored and owned.

The rule store_image keeps holds: an image only another tenant stored is not found by the tenant's SELECT, so
it goes the whole way (inspected, written again) and is answered from what this window computed.

Images named by id, vlmq:// or remote URL are resolved one by one as before, after the window's pending rows
are written when the reference may name one of them (an id of the window's new images, or any remote URL),
so the lookup sees what store_image would have inserted by then.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from sqlalchemy.orm import Session

from common.domain.batch_input import LineError, parse_line
from common.domain.schemas import ChatCompletionRequest, ImagePart
from common.domain.submission_error import SubmissionError
from common.images.cache import ImageCache
from common.images.decode import ImageError, parse_data_url
from common.images.pack import ImagePack
from common.images.refs import ResolvedImage
from common.images.stored import (
    IMAGE_ID_RE,
    check_image_size,
    insert_images,
    inspect_upload,
    owned_images,
    place_image,
)
from common.infra.settings import Settings
from common.infra.storage import ObjectStore

# A window holds at most this many lines, and stops taking more once their text passes WINDOW_CHARS: the
# lines, their parsed requests and the decoded images they carry stay in memory until the window is done.
WINDOW_LINES = 64
WINDOW_CHARS = 16 * 1024 * 1024

# A line as parsed: (custom_id, request), or why it cannot run.
Parsed = tuple[str, ChatCompletionRequest] | LineError


class WindowImages:
    """The images of one window of one ingestion run (one tenant, one transaction). `add` each parsed line's
    request, `lookup` once, normalise each line with this as its ImageResolver, then `store` before the next
    window."""

    def __init__(self, session: Session, store: ObjectStore, settings: Settings, tenant: str,
                 pack: ImagePack | None, cache: ImageCache[ResolvedImage]) -> None:
        self.session, self.objects, self.settings, self.tenant, self.pack = session, store, settings, tenant, pack
        self.cache = cache  # the run's: what it holds is neither decoded nor looked up again
        # A data: URL not yet resolved -> its image's (sha256, bytes), or what it is refused with.
        self._decoded: dict[str, tuple[str, bytes] | SubmissionError] = {}
        self._looked_up: set[str] = set()  # sha256s the tenant's images were looked up among
        # An image's sha256 -> what the window's bytes with that hash resolve to (the tenant's own, or stored by
        # this window), or what they are refused with.
        self._by_sha: dict[str, ResolvedImage | SubmissionError] = {}
        self._rows: list[dict[str, Any]] = []  # images rows of the new images, not yet written
        self._unwritten: set[str] = set()  # their ids

    def add(self, req: ChatCompletionRequest) -> None:
        """Decode and hash the data: URL images that normalising `req` may reach and the run has not met."""
        for url in _image_urls(req, self.settings.max_images_per_job):
            if url.startswith("data:") and url not in self._decoded and url not in self.cache:
                self._decoded[url] = self._decode(url)

    def lookup(self) -> None:
        """Which of the added images the tenant stored already: one round trip."""
        self._lookup({d[0] for d in self._decoded.values() if isinstance(d, tuple)})

    def resolve(self, url: str, compute: Callable[[], ResolvedImage]) -> ResolvedImage:
        """What `url` resolves to, through the run's cache (common/domain/submission.py ImageResolver)."""
        return self.cache.resolve(url, partial(self._resolve, url, compute))

    def store(self) -> None:
        """Write the rows of the window's new images and the tenant's owner rows: one round trip on Postgres.
        An owner row there already (another request of the tenant's stored the image meanwhile) is kept; the
        line was answered with this copy's location, as store_image answers a packed copy (a copy not packed
        lies under the image's own key, which this window has just written)."""
        rows, self._rows = self._rows, []
        self._unwritten.clear()
        insert_images(self.session, rows, self.tenant)

    def _resolve(self, url: str, compute: Callable[[], ResolvedImage]) -> ResolvedImage:
        if url.startswith("data:"):
            return self._data_url(url)
        match = IMAGE_ID_RE.match(url)
        remote = url[:8].lower().startswith(("http://", "https://"))
        if self._unwritten and (remote or (match is not None and match.group(1) in self._unwritten)):
            self.store()  # what compute looks up or inserts must see the window's new images, as before
        resolved = compute()
        # A data: URL of the same bytes later in the window is answered as store_image would: from its row.
        self._by_sha.setdefault(resolved.sha256, resolved)
        return resolved

    def _data_url(self, url: str) -> ResolvedImage:
        decoded = self._decoded.pop(url, None)
        if decoded is None:
            # Not decoded when the window was read: the run's cache held it then, and has dropped it since.
            decoded = self._decode(url)
            if isinstance(decoded, tuple) and decoded[0] not in self._looked_up:
                self._lookup({decoded[0]})
        if isinstance(decoded, SubmissionError):
            raise copy.copy(decoded)
        sha256, data = decoded
        resolved = self._by_sha.get(sha256)
        if resolved is None:
            try:
                resolved = self._new_image(sha256, data)
            except SubmissionError as exc:
                resolved = copy.copy(exc)  # without its traceback, which would keep the bytes alive
            self._by_sha[sha256] = resolved
        if isinstance(resolved, SubmissionError):
            raise copy.copy(resolved)
        return resolved

    def _new_image(self, sha256: str, data: bytes) -> ResolvedImage:
        """An image the tenant has not stored, as store_image stores it, less the INSERT (`store` does it)."""
        info = inspect_upload(data, self.settings)
        packed, row = place_image(self.objects, data, sha256, info, self.pack)
        self._rows.append(row)
        self._unwritten.add(sha256)
        return ResolvedImage(sha256, info.width * info.height, packed)

    def _decode(self, url: str) -> tuple[str, bytes] | SubmissionError:
        """The bytes of a data: URL and their sha256, or the refusal resolve_image and store_image give."""
        try:
            data = parse_data_url(url)
            check_image_size(data, self.settings)
        except ImageError as exc:
            return SubmissionError(str(exc), 400, "invalid_image")
        except SubmissionError as exc:
            return exc
        return hashlib.sha256(data).hexdigest(), data

    def _lookup(self, sha256s: set[str]) -> None:
        wanted = sha256s - self._looked_up
        if not wanted:
            return
        self._looked_up |= wanted
        for sha256, stored in owned_images(self.session, self.tenant, wanted).items():
            self._by_sha.setdefault(sha256, ResolvedImage.of(stored))


def read_window(lines: Iterator[tuple[int, str | LineError]], images: WindowImages) -> list[tuple[int, Parsed]]:
    """The next window of `lines`, parsed, each request's images added to `images`; empty at the end."""
    window: list[tuple[int, Parsed]] = []
    chars = 0
    for number, item in lines:
        parsed = item if isinstance(item, LineError) else parse_line(number, item)
        window.append((number, parsed))
        if not isinstance(parsed, LineError):
            images.add(parsed[1])
        chars += 0 if isinstance(item, LineError) else len(item)
        if len(window) >= WINDOW_LINES or chars >= WINDOW_CHARS:
            break
    return window


def _image_urls(req: ChatCompletionRequest, most: int) -> Iterator[str]:
    """The image references of `req` that normalize_request may reach: a job's first `most` images (it refuses
    the line at the next one)."""
    count = 0
    for message in req.messages:
        for part in () if isinstance(message.content, str) else message.content:
            if isinstance(part, ImagePart):
                if count == most:
                    return
                count += 1
                yield part.image_url.url
