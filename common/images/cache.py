"""What the image references of one ingestion resolved to, so an image reused by many lines is checked once.

A batch commonly sends the same picture with many prompts. Resolving a data: URL costs a base64 decode, a
hash, an SQL lookup and (the first time) a decode of the pixels; an uploaded image id costs an SQL lookup.
Within one ingestion run the answer for the same reference text cannot change (images are never deleted,
and refusals depend only on the bytes and the settings), so it is remembered under a digest of the
reference: a hit costs one sha256 of the URL text. Refusals are remembered too, and every line naming a bad
image is refused with the same error. Remote http(s) URLs are not cached: what they serve may change.

Memory stays bounded: keys are 32-byte digests, not the URLs, and the oldest entries go past `max_entries`.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Generic, TypeVar

# What a reference resolved to (the image's id and size: common/domain/submission.ResolvedImage).
Resolved = TypeVar("Resolved")


class ImageCache(Generic[Resolved]):
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        # A reference's digest -> what it resolved to, or the error it was refused with.
        self._entries: dict[bytes, Resolved | ValueError] = {}
        self.hits = self.misses = 0

    def resolve(self, url: str, compute: Callable[[], Resolved]) -> Resolved:
        """What `compute` returns for `url`, computed once per distinct reference. A ValueError it raised
        (SubmissionError is one) is raised again, as a copy, for every later use of the reference."""
        if not url.startswith(("data:", "img_", "vlmq://")):
            return compute()
        key = hashlib.sha256(url.encode()).digest()
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            try:
                entry = compute()
            except ValueError as exc:
                # Kept without traceback or context: those hold the frames, and the frames the image bytes.
                entry = copy.copy(exc)
            if len(self._entries) >= self.max_entries:
                del self._entries[next(iter(self._entries))]  # the oldest: dicts keep insertion order
            self._entries[key] = entry
        else:
            self.hits += 1
        if isinstance(entry, ValueError):
            # A copy: raising the stored instance again would chain every line's traceback onto it.
            raise copy.copy(entry)
        return entry

    def __contains__(self, url: str) -> bool:
        """Whether `resolve` would answer `url` from memory (counted as neither a hit nor a miss)."""
        return (url.startswith(("data:", "img_", "vlmq://"))
                and hashlib.sha256(url.encode()).digest() in self._entries)

    def clear(self) -> None:
        """Forget everything (a transaction that stored images rolled back)."""
        self._entries.clear()
