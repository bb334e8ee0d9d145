"""`vlmq apikey ...`: create, list and revoke tenants' API keys, straight in the database (run it where the
API's VLMQ_DATABASE_URL is set)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from common.infra.db import Database

apikey_app = typer.Typer(help="Tenants' API keys (stored hashed; a key is shown once, at creation).",
                         no_args_is_help=True)


def _db() -> Database:
    from common.infra.db import get_database
    from common.infra.migrate import upgrade
    from common.infra.settings import Settings

    settings = Settings()
    upgrade(settings.database_url)
    return get_database(settings.database_url)


@apikey_app.command("create")
def create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for (created on first key).")],
    name: Annotated[str | None, typer.Option(help="A label to recognise the key by.")] = None,
) -> None:
    """Create a key and print it: keep it, it cannot be shown again."""
    from common.domain.apikeys import ApiKeyError, create_key

    try:
        with _db().session() as session:
            created = create_key(session, tenant, name)
    except ApiKeyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"created key {created.id} for tenant {created.tenant}", err=True)
    typer.echo(created.key)


@apikey_app.command("list")
def list_(tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None) -> None:
    """Keys (ids, tenants, names, dates; never the secrets), one JSON object per line."""
    from common.domain.apikeys import list_keys

    with _db().session() as session:
        for key in list_keys(session, tenant):
            typer.echo(json.dumps({
                "id": key.id, "tenant": key.tenant, "name": key.name, "created_at": key.created_at.isoformat(),
                "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
            }))


@apikey_app.command("revoke")
def revoke(key_id: Annotated[str, typer.Argument(help="The key's id (key_...).")]) -> None:
    """Revoke a key; APIs stop accepting it within VLMQ_AUTH_CACHE_SECONDS."""
    from common.domain.apikeys import revoke_key

    with _db().session() as session:
        if not revoke_key(session, key_id):
            typer.echo(f"no active key {key_id!r}", err=True)
            raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")
