"""Images stored once, under their content hash, for every tenant that sends the same bytes, and which tenants
stored each: a tenant may see or name by id only the images it stored itself (image_owners).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session

from common.domain.batches import insert_ignoring_conflicts
from common.domain.models import DEFAULT_TENANT, ImageOwner, ImageRecord, utcnow
from common.domain.submission_error import SubmissionError
from common.images.decode import ImageError, ImageInfo, inspect_image
from common.images.pack import ImagePack, PackedImage
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, image_key

IMAGE_ID_RE = re.compile(r"^(?:vlmq://)?img_([0-9a-f]{64})$")


def image_public_id(sha256: str) -> str:
    return f"img_{sha256}"


@dataclass(frozen=True)
class StoredImage:
    """An image as one tenant sees it: its row, but created_at when this tenant first stored it."""

    id: str  # sha256 hex of the bytes
    format: str
    width: int
    height: int
    size_bytes: int
    created_at: datetime
    pack: PackedImage | None = None  # where its bytes lie in a pack; None: under image_key(id)


# Built once: a fresh select() per lookup cost more Python than the round trip (bench/ingest.py, new images).
_OWNED = (
    select(ImageRecord.id, ImageRecord.format, ImageRecord.width, ImageRecord.height, ImageRecord.size_bytes,
           ImageOwner.created_at, ImageRecord.pack_key, ImageRecord.pack_offset)
    .join(ImageOwner, ImageOwner.image_id == ImageRecord.id)
    .where(ImageOwner.tenant == bindparam("tenant")))
_OWNED_IMAGE = _OWNED.where(ImageRecord.id == bindparam("sha256"))
_OWNED_IMAGES = _OWNED.where(ImageRecord.id.in_(bindparam("sha256s", expanding=True)))


def owned_image(session: Session, tenant: str, sha256: str) -> StoredImage | None:
    """The image as `tenant` sees it, if it stored it; None for an image stored only by others, as for none at
    all. Its `created_at` is when this tenant first stored it: the image row's own would tell when anyone did."""
    row = session.execute(_OWNED_IMAGE, {"tenant": tenant, "sha256": sha256}).first()
    return None if row is None else _stored(row)


def owned_images(session: Session, tenant: str, sha256s: Collection[str]) -> dict[str, StoredImage]:
    """owned_image for many images in one round trip: those of `sha256s` that `tenant` stored, by id."""
    if not sha256s:
        return {}
    rows = session.execute(_OWNED_IMAGES, {"tenant": tenant, "sha256s": list(sha256s)})
    return {image.id: image for image in map(_stored, rows)}


def _stored(row: Any) -> StoredImage:
    sha, fmt, width, height, size_bytes, created_at, pack_key, pack_offset = row
    pack = None if pack_key is None or pack_offset is None else PackedImage(pack_key, pack_offset, size_bytes)
    return StoredImage(sha, fmt, width, height, size_bytes, created_at, pack)


def check_image_size(data: bytes, settings: Settings) -> None:
    """Refuse bytes over settings.max_image_bytes, before anything is spent on them."""
    if len(data) > settings.max_image_bytes:
        raise SubmissionError(
            f"image is {len(data)} bytes; the limit is {settings.max_image_bytes}", 413, "image_too_large"
        )


def inspect_upload(data: bytes, settings: Settings) -> ImageInfo:
    """What the image is, checked against the settings' limits (common/images/decode.py inspect_image)."""
    try:
        return inspect_image(
            data,
            max_pixels=settings.max_image_pixels,
            allowed_formats=tuple(settings.allowed_image_formats),
            max_frames=settings.max_image_frames,
            check=settings.image_check,
        )
    except ImageError as exc:
        raise SubmissionError(str(exc), 400, "invalid_image") from None


def place_image(store: ObjectStore, data: bytes, sha256: str, info: ImageInfo,
                pack: ImagePack | None) -> tuple[PackedImage | None, dict[str, Any]]:
    """Write a new image's bytes into `pack`, else an object of its own: where they lie (None: under
    image_key), and the image's row to insert."""
    packed = None
    if pack is not None:
        packed = pack.add(data)
    else:
        # No HEAD first: the key is the content's hash, so a PUT over an object left by an earlier attempt
        # writes the same bytes, and a new image (the case that reaches here) costs one S3 round trip, not two.
        store.put(image_key(sha256), data, content_type=f"image/{info.format.lower()}")
    return packed, {"id": sha256, "format": info.format, "width": info.width, "height": info.height,
                    "size_bytes": info.size_bytes, "created_at": utcnow(),
                    "pack_key": None if packed is None else packed.key,
                    "pack_offset": None if packed is None else packed.offset}


def store_image(session: Session, store: ObjectStore, data: bytes, settings: Settings,
                tenant: str = DEFAULT_TENANT, pack: ImagePack | None = None) -> StoredImage:
    """Validate and store an image once (content-addressed), owned by `tenant` from then on; returns it as
    `tenant` sees it (owned_image). With `pack`, a new image's bytes go into the pack, which the caller flushes
    before the session commits; without, into an object of its own.

    Only the tenant's own images take the short path. One that another tenant stored goes the whole way
    (checked, written again: the same bytes under the same key) and is answered from what this request
    computed, as a new image is, so neither the answer nor its timing tells a tenant that somebody else sent
    these bytes."""
    check_image_size(data, settings)
    sha256 = hashlib.sha256(data).hexdigest()
    existing = owned_image(session, tenant, sha256)
    if existing is not None:
        return existing
    info = inspect_upload(data, settings)
    packed, values = place_image(store, data, sha256, info, pack)
    if sha256 in insert_images(session, [values], tenant):
        return StoredImage(sha256, info.format, info.width, info.height, info.size_bytes, values["created_at"],
                           packed)
    # Another request of this tenant's stored it a moment ago.
    stored = owned_image(session, tenant, sha256)
    assert stored is not None  # the insert was refused only because the tenant's row is there
    # This copy's location serves as well as the row's, and the row may name none of its own.
    return stored if packed is None else replace(stored, pack=packed)


# An image's row and its owner's in one round trip (a second INSERT slowed the ingestion of new images,
# bench/ingest.py), for one image or many: their rows travel as one JSON document (as in
# common/infra/pg_bulk.py), so the text is the same for any number of images, parsed and planned once. An image
# row may be another tenant's already: the same bytes, so the same values.
_PG_INSERT_IMAGES = text(
    "WITH new AS (SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS r(id text, format text, width integer, "
    "height integer, size_bytes bigint, created_at timestamptz, pack_key text, pack_offset bigint)), "
    "image AS (INSERT INTO images (id, format, width, height, size_bytes, created_at, pack_key, pack_offset) "
    "SELECT id, format, width, height, size_bytes, created_at, pack_key, pack_offset FROM new "
    "ON CONFLICT (id) DO NOTHING) "
    "INSERT INTO image_owners (tenant, image_id, created_at) SELECT CAST(:tenant AS text), id, created_at FROM new "
    "ON CONFLICT (tenant, image_id) DO NOTHING RETURNING image_id")


def insert_images(session: Session, rows: list[dict[str, Any]], tenant: str) -> set[str]:
    """INSERT .. ON CONFLICT DO NOTHING the images' rows (as place_image builds them, each id once) and their
    owner rows, in one round trip on Postgres: the ids whose owner row was new."""
    if not rows:
        return set()
    if session.get_bind().dialect.name == "postgresql":
        document = json.dumps([{**row, "created_at": row["created_at"].isoformat()} for row in rows])
        return set(session.scalars(_PG_INSERT_IMAGES, {"rows": document, "tenant": tenant}))
    insert_ignoring_conflicts(session, ImageRecord, rows, ["id"])
    owners = [{"tenant": tenant, "image_id": row["id"], "created_at": row["created_at"]} for row in rows]
    return insert_ignoring_conflicts(session, ImageOwner, owners, ["tenant", "image_id"],
                                     returning=ImageOwner.image_id)
