"""Alembic environment: the URL comes from vlmq's Settings unless the caller set one."""

from __future__ import annotations

from typing import Any, Literal

from alembic import context

from common.domain.models import Base, UTCDateTime
from common.infra.db import make_engine, normalize_url
from common.infra.settings import get_settings

config = context.config


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # Migrations must not import our TypeDecorator: render its plain SQL type.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False

target_metadata = Base.metadata


def _url() -> str:
    return normalize_url(config.get_main_option("sqlalchemy.url") or get_settings().database_url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True,
                          render_item=_render_item)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=target_metadata, render_as_batch=True,
                          render_item=_render_item)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                          render_item=_render_item)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
