"""files and batches: the OpenAI Files/Batches tables, refused batch lines, image archives of native
datasets, and one job per custom_id per batch

The unique (batch_id, custom_id) index is what ingestion detects duplicate custom_ids with. Jobs written
before it (`vlmq run`) already had distinct custom_ids per batch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 09:14:24.716902
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('batch_images',
    sa.Column('batch_id', sa.String(length=48), nullable=False),
    sa.Column('path_hash', sa.String(length=64), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('image_id', sa.String(length=64), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('batch_id', 'path_hash')
    )
    op.create_table('batch_line_errors',
    sa.Column('batch_id', sa.String(length=48), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=512), nullable=True),
    sa.Column('code', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('batch_id', 'line')
    )
    op.create_table('batches',
    sa.Column('id', sa.String(length=48), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('input_file_id', sa.String(length=48), nullable=False),
    sa.Column('model', sa.String(length=255), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_file_id', sa.String(length=48), nullable=True),
    sa.Column('error_file_id', sa.String(length=48), nullable=True),
    sa.Column('images_file_id', sa.String(length=48), nullable=True),
    sa.Column('images_indexed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('images_root', sa.String(length=255), nullable=True),
    sa.Column('ingested_lines', sa.Integer(), nullable=False),
    sa.Column('total_requests', sa.Integer(), nullable=False),
    sa.Column('refused_requests', sa.Integer(), nullable=False),
    sa.Column('completed_requests', sa.Integer(), nullable=False),
    sa.Column('failed_requests', sa.Integer(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=True),
    sa.Column('output_tokens', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batches_status'), ['status'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=48), nullable=False),
    sa.Column('object_key', sa.String(length=255), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index('ux_jobs_batch_id_custom_id', ['batch_id', 'custom_id'], unique=True)


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ux_jobs_batch_id_custom_id')

    op.drop_table('files')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_status'))

    op.drop_table('batches')
    op.drop_table('batch_line_errors')
    op.drop_table('batch_images')
