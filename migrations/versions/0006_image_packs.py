"""images stored in packs

images.pack_key, images.pack_offset: the pack object (common/images/pack.py) an image's bytes lie in and where;
NULL for images stored as objects of their own, as every image before was.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pack_key', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('pack_offset', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Older code reads every image from images/<sha256>: an image whose only copy is in a pack would be lost
    # to it, and every job naming it would fail.
    packed = op.get_bind().execute(sa.text("SELECT id FROM images WHERE pack_key IS NOT NULL LIMIT 1")).first()
    if packed is not None:
        raise RuntimeError("images are stored in packs (images.pack_key): copy each to images/<sha256> and "
                           "clear pack_key before downgrading below 0006")
    with op.batch_alter_table('images', schema=None) as batch_op:
        batch_op.drop_column('pack_offset')
        batch_op.drop_column('pack_key')
