"""`vlmq run`'s look at its input file before anything heavy is loaded (torch, the model, the database).

A file nothing of which can run (empty, only lines that are not requests, a CSV without its columns) ends the
run in moments with the reason, not after the model's load. Only what ingestion (worker/batches/ingest.py) would refuse
for sure is refused here, with the same checks and codes: reading stops at the first line that parses as a
request, and a file whose lines parse but fail later (an image that is not one) goes through ingestion as
before. A pipe can be read once, so it is left to ingestion.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.domain.batch_input import LineError, iter_lines, parse_line
from common.infra.settings import Settings
from worker.batches.dataset import DatasetError, iter_csv_lines

CHUNK_BYTES = 1 << 20
# Past this many refused lines with no request among them, ingestion takes over (it keeps them in SQL, not here).
MAX_HELD_ERRORS = 10_000
MAX_LISTED_ERRORS = 5


@dataclass
class UnrunnableInput:
    """Why nothing in the file can run: the batch's errors (OpenAI BatchError shape) and every refused line."""

    errors: list[dict[str, Any]]
    line_errors: list[LineError] = field(default_factory=list)


def unrunnable_input(path: Path, settings: Settings) -> UnrunnableInput | None:
    """None when some line of the file parses as a request (or the input is not a regular file); raises OSError
    when it cannot be read."""
    if not path.is_file():
        return None
    read = iter_csv_lines if path.name.lower().endswith(".csv") else iter_lines
    refused: list[LineError] = []
    seen: set[str] = set()
    try:
        for number, item in read(_chunks(path), settings.max_body_bytes):
            outcome = item if isinstance(item, LineError) else parse_line(number, item, seen)
            if not isinstance(outcome, LineError):
                return None
            refused.append(outcome)
            if len(refused) > MAX_HELD_ERRORS:
                return None
    except DatasetError as exc:  # a CSV manifest whose header is unusable
        return UnrunnableInput([{"code": "invalid_manifest", "line": None, "message": str(exc), "param": None}])
    if not refused:
        return UnrunnableInput([{"code": "empty_file", "line": None, "param": None,
                                 "message": "the input file has no requests"}])
    return UnrunnableInput([e.as_batch_error() for e in refused[:MAX_LISTED_ERRORS]], refused)


def at_most_lines(path: Path, max_lines: int) -> bool:
    """Whether the file (a regular one: a pipe cannot be read twice) holds at most `max_lines` lines; reads no
    further than the line after them."""
    if not path.is_file():
        return False
    lines = 0
    for chunk in _chunks(path):
        lines += chunk.count(b"\n")
        if lines > max_lines:
            return False
    return True


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk
