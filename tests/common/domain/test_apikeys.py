"""API keys: shown once, stored hashed, checked against the hash, revocable."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from common.domain import apikeys
from common.domain.models import ApiKey
from common.infra.db import Database


def test_create_check_and_revoke(db: Database) -> None:
    tenant = f"acme-{uuid.uuid4().hex[:8]}"  # the Postgres database is the test session's: others make keys too
    with db.session() as session:
        created = apikeys.create_key(session, tenant, "ci")
    assert created.key.startswith(f"vlmq-{created.id}.")
    with db.session() as session:
        row = session.scalar(select(ApiKey).where(ApiKey.id == created.id))
        assert row is not None and created.key.split(".", 1)[1] not in row.secret_sha256  # only a hash is kept
        assert apikeys.tenant_of(session, created.key) == tenant
        wrong_secret = created.key[:-4] + ("AAAA" if not created.key.endswith("AAAA") else "BBBB")
        assert apikeys.tenant_of(session, wrong_secret) is None
        for bad in ("", "vlmq-", created.id, created.key + "x", "Bearer " + created.key):
            assert apikeys.tenant_of(session, bad) is None
        assert [k.id for k in apikeys.list_keys(session, tenant)] == [created.id]
    with db.session() as session:
        assert apikeys.revoke_key(session, created.id)
        assert not apikeys.revoke_key(session, created.id)
    with db.session() as session:
        assert apikeys.tenant_of(session, created.key) is None


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "../etc", "-lead", "ünï"])
def test_tenant_names_are_checked(db: Database, name: str) -> None:
    with db.session() as session, pytest.raises(apikeys.ApiKeyError):
        apikeys.create_key(session, name)
