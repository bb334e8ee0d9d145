"""When files expire: `expires_after` on an upload (POST /v1/files) and `output_expires_after` on a batch, as
OpenAI's API takes them, and the sweep that deletes what has expired.

OpenAI's rule: the anchor is the file's `created_at`, and the time is 1 hour to 30 days. An expired file is
deleted (row first, then object, as DELETE /v1/files/{id} does) by the maintenance sweep, unless a batch is
still ingesting it; it is then deleted once that batch has moved on.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from common.domain import batches
from common.domain.models import FileRecord, utcnow
from common.infra.db import Database
from common.infra.storage import ObjectStore

log = logging.getLogger(__name__)

MIN_SECONDS, MAX_SECONDS = 3600, 30 * 24 * 3600
DELETED_PER_SWEEP = 1000


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_SECONDS, le=MAX_SECONDS)

    def expires_at(self, created_at: datetime) -> datetime:
        return created_at + timedelta(seconds=self.seconds)


def delete_expired_files(db: Database, store: ObjectStore, limit: int = DELETED_PER_SWEEP) -> int:
    """Delete up to `limit` files past their expiry; returns how many."""
    now = utcnow()
    with db.session() as session:
        expired = list(session.execute(
            select(FileRecord.id, FileRecord.object_key)
            .where(FileRecord.expires_at.is_not(None), FileRecord.expires_at <= now,
                   ~batches.ingesting(FileRecord.id).exists())
            .order_by(FileRecord.expires_at).limit(limit)))
        if expired:
            session.execute(FileRecord.__table__.delete().where(FileRecord.id.in_([r.id for r in expired])))
    for row in expired:
        try:
            store.delete(row.object_key)
        except Exception:  # the row is gone, so the file is; an object left behind is only space
            log.warning("file %s: its object %s could not be deleted", row.id, row.object_key, exc_info=True)
    return len(expired)
