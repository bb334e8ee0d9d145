from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.infra.db import Database
from common.infra.migrate import upgrade


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A migrated database on each backend vlmq runs on; Postgres tables are emptied afterwards."""
    sqlite = request.param == "sqlite"
    url = f"sqlite:///{tmp_path / 'vlmq.db'}" if sqlite else request.getfixturevalue("pg_url")
    upgrade(url)
    database = Database(url)
    yield database
    from sqlalchemy import text

    with database.session() as session:
        session.execute(text("DELETE FROM jobs"))
        session.execute(text("DELETE FROM images"))
        session.execute(text("DELETE FROM api_keys"))
    database.dispose()
