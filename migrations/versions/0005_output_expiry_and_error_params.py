"""batch output expiry, the field at fault in a refused batch line, and an index for expired files

batches.output_expires_seconds: `output_expires_after.seconds` of POST /v1/batches, NULL (kept until deleted)
for batches made before. batch_line_errors.param: the line's field at fault (`custom_id`, `body`, ...), shown
as `param` in a failed batch's errors; NULL for lines refused before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 07:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('output_expires_seconds', sa.Integer(), nullable=True))
    with op.batch_alter_table('batch_line_errors', schema=None) as batch_op:
        batch_op.add_column(sa.Column('param', sa.String(length=64), nullable=True))
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_files_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_files_expires_at'))
    with op.batch_alter_table('batch_line_errors', schema=None) as batch_op:
        batch_op.drop_column('param')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('output_expires_seconds')
