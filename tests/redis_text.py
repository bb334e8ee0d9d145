"""Redis replies as text in tests: redis-py types every reply as bytes | str, and these clients answer bytes."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
