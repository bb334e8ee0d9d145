"""The API's memory of image ids it has seen owned in SQL, with what they resolved to: bounded, most recently
used kept."""

from __future__ import annotations

from common.images.pack import PackedImage
from common.images.refs import KnownImages, ResolvedImage

A, B, C = (ResolvedImage("a", 10), ResolvedImage("b", 20, PackedImage("packs/p", 5, 7)), ResolvedImage("c", 30))


def test_known_images_keep_the_most_recently_used() -> None:
    known = KnownImages(capacity=2)
    known.add(("t", "a"), A)
    known.add(("t", "b"), B)
    assert known.get(("t", "a")) == A  # now the most recent
    known.add(("t", "c"), C)
    assert known.get(("t", "a")) == A and known.get(("t", "c")) == C and known.get(("t", "b")) is None
    assert known.get(("t", "never")) is None and known.get(("other", "a")) is None
