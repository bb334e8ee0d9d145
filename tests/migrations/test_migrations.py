"""The Alembic revisions and the SQLAlchemy models describe the same schema, on Postgres and SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from common.db import make_engine
from common.migrate import upgrade
from common.models import Base


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_models_match_migrations(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'm.db'}"
    else:
        # A database of its own: other tests' tables must not mask a missing one.
        import uuid

        import psycopg

        from tests.conftest import PG_ADMIN_URL

        name = f"vlmq_mig_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        request.addfinalizer(lambda: _drop(name))
        url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    upgrade(url)
    upgrade(url)  # idempotent
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
            assert diff == []
            assert {"jobs", "images", "alembic_version"} <= set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def _drop(name: str) -> None:
    import psycopg

    from tests.conftest import PG_ADMIN_URL

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
