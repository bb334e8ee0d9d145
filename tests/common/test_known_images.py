"""The API's memory of image ids it has seen in SQL: bounded, most recently used kept."""

from __future__ import annotations

from common.submission import KnownImages


def test_known_images_keep_the_most_recently_used() -> None:
    known = KnownImages(capacity=2)
    known.add(("t", "a"))
    known.add(("t", "b"))
    assert ("t", "a") in known  # now the most recent
    known.add(("t", "c"))
    assert ("t", "a") in known and ("t", "c") in known and ("t", "b") not in known
    assert ("t", "never") not in known and ("other", "a") not in known
