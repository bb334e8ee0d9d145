"""The API's memory of image ids it has seen in SQL: bounded, most recently used kept."""

from __future__ import annotations

from common.submission import KnownImages


def test_known_images_keep_the_most_recently_used() -> None:
    known = KnownImages(capacity=2)
    known.add("a")
    known.add("b")
    assert "a" in known  # now the most recent
    known.add("c")
    assert "a" in known and "c" in known and "b" not in known
    assert "never" not in known
