"""Native datasets: a JSONL or CSV manifest plus a zip or tar of images named by relative path. No Celery.

Before any line is read, every image in the archive (worker/batches/archive.py: read in memory, never extracted, with
caps against archive bombs) is checked and stored once under its content hash, and indexed by path in
batch_images, a chunk of members per transaction (memory bounded by a chunk; a redelivered task just repeats
idempotent inserts). A member refused by name, type or size is indexed with its error. A line's path then
becomes that stored image's id before the usual checks, so a path line is accepted or refused exactly like a
line with a data: URL.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from common.domain.batch_input import CHAT_URL, LineError
from common.domain.batches import insert_ignoring_conflicts
from common.domain.files import ChunkStream
from common.domain.models import Batch, BatchImage, BatchStatus, FileRecord, utcnow
from common.domain.schemas import ChatCompletionRequest, ImagePart
from common.domain.submission import SubmissionError
from common.images.pack import ImagePack
from common.images.stored import IMAGE_ID_RE, image_public_id, store_image
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectNotFound, ObjectStore
from worker.batches import archive
from worker.batches.archive import Member, normalize_path

MEMBERS_PER_CHUNK = 100
CHUNK_BYTES = 64 * 1024 * 1024  # a chunk of members is held in memory until its transaction commits
CSV_COLUMNS = ("custom_id", "prompt", "image", "system", "max_tokens", "temperature", "top_p", "seed")
_SURROGATE = re.compile("[\udc80-\udcff]")


class DatasetError(ValueError):
    """The archive or the manifest as a whole is unusable; the batch fails with this message."""


def _path_hash(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()


def _take(members: Iterator[Member], max_items: int, max_bytes: int) -> list[Member]:
    """The next members, at most max_items of them and (beyond the first) max_bytes of image data."""
    part: list[Member] = []
    size = 0
    for member in members:
        part.append(member)
        size += len(member[1]) if isinstance(member[1], bytes) else 0
        if len(part) >= max_items or size >= max_bytes:
            break
    return part


def index_archive(batch_id: str, images_file_id: str, db: Database, store: ObjectStore,
                  settings: Settings, tenant: str) -> str | None:
    """Store and index the batch's image archive, its images owned by the batch's `tenant`; None when done
    (or the batch left validating), else why the batch must fail."""
    with db.session() as session:
        record = session.get(FileRecord, images_file_id)
    if record is None:
        return f"images file {images_file_id!r} no longer exists"
    roots: set[str] = set()
    flat = False
    members = archive.members(store, record, archive.ArchiveLimits.of(settings))
    pack = ImagePack.for_settings(store, settings)
    try:
        while part := _take(members, MEMBERS_PER_CHUNK, CHUNK_BYTES):
            with db.session() as session:
                rows = []
                for path, data in part:
                    top, nested, _ = path.partition("/")
                    flat = flat or not nested
                    if len(roots) < 2:
                        roots.add(top)
                    image_id = error = None
                    if isinstance(data, str):
                        error = data
                    else:
                        try:
                            image_id = store_image(session, store, data, settings, tenant, pack).id
                        except SubmissionError as exc:
                            error = str(exc)
                    rows.append({"batch_id": batch_id, "path_hash": _path_hash(path), "path": path,
                                 "image_id": image_id, "error": error})
                insert_ignoring_conflicts(session, BatchImage, rows, ["batch_id", "path_hash"])
                if pack is not None:
                    pack.flush()  # before the commit that names its images, whichever way this part ends
                if session.scalar(select(Batch.status).where(Batch.id == batch_id)) != BatchStatus.VALIDATING:
                    return None  # cancelled meanwhile
    except archive.ArchiveError as exc:
        return str(exc)
    except ObjectNotFound:
        return f"images file {images_file_id!r} is missing from storage"
    # A zip of a folder holds "folder/a.png" while the manifest says "a.png": both spellings resolve.
    root = next(iter(roots)) if len(roots) == 1 and not flat else None
    with db.session() as session:
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
                        .values(images_indexed_at=utcnow(), images_root=root))
    return None


def _is_reference(url: str) -> bool:
    return url.startswith(("data:", "http://", "https://")) or IMAGE_ID_RE.match(url) is not None


def resolve_paths(session: Session, batch_id: str, root: str | None, req: ChatCompletionRequest, number: int,
                  custom_id: str) -> LineError | None:
    """Replace each image path of `req` by the id of the archive's image at that path (in place)."""
    for message in req.messages:
        for part in message.content if isinstance(message.content, list) else ():
            if not isinstance(part, ImagePart) or _is_reference(part.image_url.url):
                continue
            path = normalize_path(part.image_url.url)
            if path is None:
                return LineError(number, custom_id, "invalid_path", f"line {number}: image path "
                                 f"{part.image_url.url[:200]!r} climbs out of the archive ('..') or is empty")
            candidates = [path, f"{root}/{path}"] if path and root else [path] if path else []
            entry = next((e for p in candidates if (e := session.get(BatchImage, (batch_id, _path_hash(p))))), None)
            if entry is None:
                return LineError(number, custom_id, "image_not_found",
                                 f"line {number}: {part.image_url.url!r} is not in the images archive")
            if entry.image_id is None:
                return LineError(number, custom_id, "invalid_image",
                                 f"line {number}: image {part.image_url.url!r}: {entry.error}")
            part.image_url.url = image_public_id(entry.image_id)
    return None


def iter_csv_lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, str | LineError]]:
    """A CSV manifest as OpenAI batch lines: (line number, JSON line or error), like
    common.domain.batch_input.iter_lines.

    Columns: prompt (required), image (paths separated by '|'), custom_id (default line-<n>), system,
    max_tokens, temperature, top_p, seed."""
    # surrogateescape: a byte that is not UTF-8 spoils only its own row (found below), not the block around it.
    text = io.TextIOWrapper(io.BufferedReader(ChunkStream(iter(chunks))), encoding="utf-8-sig", newline="",
                            errors="surrogateescape")
    reader = csv.reader(text)
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        return
    except csv.Error as exc:
        raise DatasetError(f"the CSV header cannot be read: {exc}") from None
    unknown = [h for h in header if h not in CSV_COLUMNS]
    if unknown or "prompt" not in header or len(set(header)) != len(header):
        raise DatasetError(f"CSV columns must be distinct, include 'prompt' and come from {', '.join(CSV_COLUMNS)}"
                           f" (got {', '.join(header)})")
    while True:
        number = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield number, LineError(number, None, "invalid_csv", f"line {number}: {exc}")
            continue
        if not any(cell.strip() for cell in row):
            continue
        if _SURROGATE.search("".join(row)):
            yield number, LineError(number, None, "invalid_utf8", f"line {number} is not valid UTF-8")
            continue
        if len(row) != len(header):
            # A quote left open runs on into the lines below: say which lines this record took.
            span = f"lines {number}-{reader.line_num} (a quoted field runs across them)" \
                if reader.line_num > number else f"line {number}"
            # No custom_id: with the fields miscounted, the one in its column may be another column's value.
            yield number, LineError(number, None, "invalid_csv",
                                    f"{span} has {len(row)} fields; the header has {len(header)}")
            continue
        line = json.dumps(_csv_request(dict(zip(header, row, strict=True)), number))
        if len(line) > max_line_bytes:
            yield number, LineError(number, None, "line_too_long", f"line {number} is too long")
            continue
        yield number, line


def _csv_request(values: dict[str, str], number: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": p.strip()}}
                                     for p in values.get("image", "").split("|") if p.strip()]
    content.append({"type": "text", "text": values["prompt"]})
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if values.get("system", "").strip():
        messages.insert(0, {"role": "system", "content": values["system"]})
    body: dict[str, Any] = {"messages": messages}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if values.get(name, "").strip():
            body[name] = values[name].strip()  # "8" -> 8 by the request model's own validation
    return {"custom_id": values.get("custom_id", "").strip() or f"line-{number}", "method": "POST", "url": CHAT_URL,
            "body": body}
