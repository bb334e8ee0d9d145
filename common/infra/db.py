"""SQLAlchemy engine and session scope, shared by the API, the workers and the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """Use psycopg 3 for plain `postgresql://` URLs (psycopg2 is not a dependency)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def rowcount(session: Session | Connection, stmt: Executable) -> int:
    """Run an UPDATE or DELETE and say how many rows it matched. Session.execute is typed to return a Result;
    for such a statement it is the CursorResult that has the count."""
    return cast(CursorResult[Any], session.execute(stmt)).rowcount


def make_engine(url: str, *, pre_ping: bool = True, pool_size: int = 40) -> Engine:
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Many worker threads share one file: WAL lets readers run beside the writer, and busy_timeout
        # turns "database is locked" into a short wait.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # Take transaction control from pysqlite so SAVEPOINTs work (SQLAlchemy's documented recipe).
            dbapi_conn.isolation_level = None
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            # IMMEDIATE takes the write lock up front: a deferred transaction that later writes can fail
            # at once with "database is locked" when another thread writes, whatever busy_timeout says.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # pre_ping: a restarted Postgres leaves dead pooled connections behind. pool_size: connections beyond it
    # are closed when returned, and Postgres forks a backend per connection, so a pool smaller than the
    # threads that use it (the API's thread pool runs up to 40) opened and closed a connection per request
    # under load, a cost to the API's CPU and more to Postgres' (bench/ingest.py). Idle pooled connections
    # cost Postgres little; max_overflow still bounds a burst.
    return create_engine(url, pool_pre_ping=pre_ping, pool_size=pool_size, max_overflow=20)


class Database:
    """An engine plus a session factory; one per process and URL. `pre_ping=False` and a small pool are for a
    single thread that retries its own transactions (worker/jobs/state_writer.py)."""

    def __init__(self, url: str, *, pre_ping: bool = True, pool_size: int = 40) -> None:
        self.url = url
        self.engine = make_engine(url, pre_ping=pre_ping, pool_size=pool_size)
        self.session_factory = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: commits on success, rolls back on error."""
        with self.session_factory() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


_databases: dict[str, Database] = {}


def get_database(url: str) -> Database:
    db = _databases.get(url)
    if db is None:
        db = _databases[url] = Database(url)
    return db
