"""Values a request may carry into SQL, object storage and our JSON answers.

JSON lets a client write things that parse in Python but cannot be stored or written back out: a lone UTF-16
surrogate (`"\\udc00"`), which no UTF-8 encoder accepts, and (in Python's reading of JSON) NaN, Infinity and
numbers like 1e999 that overflow to infinity, which Postgres' json type refuses. Found past the edge, one such
value fails a whole group commit or bulk insert, or a stored row that every later read of the tenant's list
trips over; so every request body is checked here first and refused with a message naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Nesting deeper than this is refused before the walk could exhaust the stack (json.loads allows ~1,000).
MAX_DEPTH = 200


class UnstorableValue(ValueError):
    """A value that cannot be stored; the message names where it is, never the value itself."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads(raw: str | bytes) -> Any:
    """json.loads, refusing NaN, Infinity and numbers that overflow a double (ValueError)."""
    return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)


def is_valid_text(text: str) -> bool:
    """False for text holding a lone surrogate (no UTF-8 encoder, Postgres or JSON writer accepts it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check(value: Any, where: str = "") -> None:
    """Raise UnstorableValue if anything in `value` (keys included) is text that is not valid Unicode (a lone
    surrogate), a float that is not finite, or nested deeper than MAX_DEPTH."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if not is_valid_text(item):
                raise UnstorableValue(f"{path or 'the value'} contains a lone surrogate (\\ud800-\\udfff), "
                                      "which is not valid Unicode text")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise UnstorableValue(f"{path or 'the value'} is {item}; only finite numbers are accepted")
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_DEPTH:
                raise UnstorableValue(f"{path or 'the value'} is nested more than {MAX_DEPTH} levels deep")
            if isinstance(item, dict):
                for key, child in item.items():
                    name = _join(path, key)
                    if isinstance(key, str) and not is_valid_text(key):
                        raise UnstorableValue(f"a key in {path or 'the value'} contains a lone surrogate "
                                              "(\\ud800-\\udfff), which is not valid Unicode text")
                    stack.append((child, name, depth + 1))
            else:
                stack.extend((child, _join(path, i), depth + 1) for i, child in enumerate(item))


def _join(path: str, key: object) -> str:
    part = key if isinstance(key, int) else _safe(str(key))
    return f"{path}.{part}" if path else str(part)


def _safe(text: str) -> str:
    """A key as it may appear in an error message: short, and with bad characters escaped."""
    short = text[:40]
    return short if is_valid_text(short) else short.encode("utf-8", "backslashreplace").decode("ascii")
