"""The Alembic revisions and the SQLAlchemy models describe the same schema, on Postgres and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, Table, inspect, text
from sqlalchemy.orm import Session

from common.domain.models import Base, ImageOwner
from common.infra.db import make_engine
from common.infra.migrate import upgrade


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    # A database of its own: other tests' tables must not mask a missing one.
    import uuid

    import psycopg

    from tests.conftest import PG_ADMIN_URL

    name = f"vlmq_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    request.addfinalizer(lambda: _drop(name))
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def test_models_match_migrations(url: str) -> None:
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


def _row(table: Table, **values: Any) -> dict[str, Any]:
    """`values`, and something of the right type for every other column that needs one."""
    row = dict(values)
    for column in table.columns:
        if column.name in row or column.nullable or column.server_default is not None:
            continue
        python_type = column.type.python_type
        row[column.name] = {str: "x", int: 0, dict: {}, datetime: datetime.now(UTC)}[python_type]
    return row


def test_image_owners_are_recovered_from_jobs_and_archives(url: str) -> None:
    """0004: a tenant owns each image its jobs name, and each image of its batches' archives; an image
    nothing refers to has no owner."""
    upgrade(url, "0003")
    engine = make_engine(url)
    try:
        tables = MetaData()
        tables.reflect(engine)
        jobs, batch_images, batches, images = (tables.tables[name] for name in
                                               ("jobs", "batch_images", "batches", "images"))
        image = {"type": "image", "image_id": "a" * 64}
        first_use = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        with engine.begin() as conn:
            conn.execute(images.insert(), [_row(images, id=c * 64) for c in "abcd"])
            conn.execute(jobs.insert(), [
                _row(jobs, id="job_1", tenant="t1", created_at=first_use, request={"messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi"}, image]},
                    {"role": "user", "content": [{"type": "image", "image_id": "b" * 64}]}]}),
                _row(jobs, id="job_2", tenant="t2", request={"messages": [{"role": "user", "content": [image]}]}),
                _row(jobs, id="job_3", tenant="t1", request={"messages": [{"role": "user", "content": [image]}]}),
                _row(jobs, id="job_4", tenant="t3", request={"messages": [
                    {"role": "user", "content": [{"type": "text", "text": "no image"}]}]}),
            ])
            conn.execute(batches.insert(), [_row(batches, id="batch_1", tenant="t3")])
            conn.execute(batch_images.insert(), [
                _row(batch_images, batch_id="batch_1", path_hash="p1", image_id="c" * 64),
                _row(batch_images, batch_id="batch_1", path_hash="p2", image_id=None, error="not an image")])
        upgrade(url)
        with engine.connect() as conn:
            owners = {tuple(row) for row in conn.execute(text("SELECT tenant, image_id FROM image_owners"))}
        assert owners == {("t1", "a" * 64), ("t1", "b" * 64), ("t2", "a" * 64), ("t3", "c" * 64)}
        with Session(engine) as session:  # owned since the tenant's first job that named it
            owner = session.get(ImageOwner, ("t1", "a" * 64))
            assert owner is not None and owner.created_at == first_use
    finally:
        engine.dispose()


def _drop(name: str) -> None:
    import psycopg

    from tests.conftest import PG_ADMIN_URL

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_downgrading_below_image_packs_refuses_while_an_image_lies_only_in_one(url: str) -> None:
    from alembic import command

    from common.infra.migrate import alembic_config

    upgrade(url)
    engine = make_engine(url)
    try:
        command.downgrade(alembic_config(url), "0005")  # no packed image: it goes down, and up again
        upgrade(url)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO images (id, format, width, height, size_bytes, created_at, pack_key, "
                              "pack_offset) VALUES ('abc', 'PNG', 1, 1, 3, :now, 'packs/p', 0)"),
                         {"now": datetime.now(UTC)})
        with pytest.raises(RuntimeError, match="images are stored in packs"):
            command.downgrade(alembic_config(url), "0005")
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT pack_key FROM images WHERE id = 'abc'")) == "packs/p"
    finally:
        engine.dispose()
