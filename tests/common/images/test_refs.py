"""The API's memory of image ids it has seen owned in SQL, with their pixels: bounded, most recently used kept."""

from __future__ import annotations

from common.images.refs import KnownImages


def test_known_images_keep_the_most_recently_used() -> None:
    known = KnownImages(capacity=2)
    known.add(("t", "a"), 10)
    known.add(("t", "b"), 20)
    assert known.get(("t", "a")) == 10  # now the most recent
    known.add(("t", "c"), 30)
    assert known.get(("t", "a")) == 10 and known.get(("t", "c")) == 30 and known.get(("t", "b")) is None
    assert known.get(("t", "never")) is None and known.get(("other", "a")) is None
