"""tenants and fair dispatch: API keys, a tenant on jobs, batches and files, jobs.dispatched_at,
Idempotency-Keys unique per tenant instead of globally, an index for batches' completion rates, and each
batch job's input line

Rows written before tenants existed belong to the `default` tenant. Jobs already queued or running were sent
to the broker when they were written, so they count as dispatched.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 17:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0001 left the unique constraint on jobs.idempotency_key unnamed: Postgres named it itself, SQLite did not,
# so batch mode (which rebuilds the table on SQLite) needs a naming convention to find it.
_SQLITE_UQ = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=48), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=True),
    sa.Column('secret_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant'), ['tenant'], unique=False)

    for table in ('batches', 'files'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('tenant', sa.String(length=64), nullable=False,
                                          server_default='default'))
            batch_op.create_index(batch_op.f(f'ix_{table}_tenant'), ['tenant'], unique=False)

    sqlite = op.get_bind().dialect.name == 'sqlite'
    with op.batch_alter_table('jobs', schema=None, naming_convention=_SQLITE_UQ if sqlite else None) as batch_op:
        batch_op.add_column(sa.Column('tenant', sa.String(length=64), nullable=False, server_default='default'))
        batch_op.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('line', sa.Integer(), nullable=True))
        batch_op.drop_constraint('uq_jobs_idempotency_key' if sqlite else 'jobs_idempotency_key_key',
                                 type_='unique')
        batch_op.create_index('ix_jobs_dispatch', ['tenant', 'model', 'status', 'dispatched_at', 'id'],
                              unique=False)
        batch_op.create_index('ux_jobs_tenant_idempotency_key', ['tenant', 'idempotency_key'], unique=True)
        batch_op.create_index('ix_jobs_batch_id_finished_at', ['batch_id', 'finished_at'], unique=False)
    jobs = sa.table('jobs', sa.column('status', sa.String), sa.column('created_at', sa.DateTime(timezone=True)),
                    sa.column('dispatched_at', sa.DateTime(timezone=True)))
    op.execute(jobs.update().where(jobs.c.status.in_(('queued', 'running')))
               .values(dispatched_at=jobs.c.created_at))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index('ix_jobs_batch_id_finished_at')
        batch_op.drop_index('ux_jobs_tenant_idempotency_key')
        batch_op.drop_index('ix_jobs_dispatch')
        batch_op.create_unique_constraint('jobs_idempotency_key_key', ['idempotency_key'])
        batch_op.drop_column('line')
        batch_op.drop_column('dispatched_at')
        batch_op.drop_column('tenant')
    for table in ('files', 'batches'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(batch_op.f(f'ix_{table}_tenant'))
            batch_op.drop_column('tenant')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant'))
    op.drop_table('api_keys')
