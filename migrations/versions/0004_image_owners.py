"""image owners: which tenants stored each image

An image is stored once, under its content hash, whoever sends it; from now on a tenant may look up or name
by id only the images it stored. Ownership of images stored before is recovered from what refers to them: the
jobs whose requests name them and the archives of batches, each owned since the first of them was made. An
image uploaded (POST /v1/images) and never used has no owner after this; uploading it again, which is
idempotent, makes its uploader the owner.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Image parts of stored requests look like {"type": "image", "image_id": "<sha256>"} (common/domain/submission.py).
_FROM_JOBS = {
    'postgresql': """
        INSERT INTO image_owners (tenant, image_id, created_at)
        SELECT jobs.tenant, part ->> 'image_id', min(jobs.created_at)
        FROM jobs, json_array_elements(jobs.request -> 'messages') AS message,
             json_array_elements(message -> 'content') AS part
        WHERE part ->> 'type' = 'image' AND part ->> 'image_id' IS NOT NULL
        GROUP BY 1, 2
        ON CONFLICT DO NOTHING""",
    'sqlite': """
        INSERT OR IGNORE INTO image_owners (tenant, image_id, created_at)
        SELECT jobs.tenant, json_extract(part.value, '$.image_id'), min(jobs.created_at)
        FROM jobs, json_each(jobs.request, '$.messages') AS message,
             json_each(message.value, '$.content') AS part
        WHERE json_extract(part.value, '$.type') = 'image'
          AND json_extract(part.value, '$.image_id') IS NOT NULL
        GROUP BY 1, 2""",
}
_FROM_ARCHIVES = {
    'postgresql': """
        INSERT INTO image_owners (tenant, image_id, created_at)
        SELECT batches.tenant, batch_images.image_id, min(batches.created_at)
        FROM batch_images JOIN batches ON batches.id = batch_images.batch_id
        WHERE batch_images.image_id IS NOT NULL
        GROUP BY 1, 2
        ON CONFLICT DO NOTHING""",
    'sqlite': """
        INSERT OR IGNORE INTO image_owners (tenant, image_id, created_at)
        SELECT batches.tenant, batch_images.image_id, min(batches.created_at)
        FROM batch_images JOIN batches ON batches.id = batch_images.batch_id
        WHERE batch_images.image_id IS NOT NULL
        GROUP BY 1, 2""",
}


def upgrade() -> None:
    op.create_table('image_owners',
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('image_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('tenant', 'image_id')
    )
    dialect = op.get_bind().dialect.name
    if dialect in _FROM_JOBS:
        op.execute(_FROM_JOBS[dialect])
        op.execute(_FROM_ARCHIVES[dialect])


def downgrade() -> None:
    op.drop_table('image_owners')
