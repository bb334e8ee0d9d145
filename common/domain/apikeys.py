"""Tenants' API keys: created, checked, listed, revoked. Torch-free; used by the API and the CLI.

A key reads `vlmq-<key id>.<secret>`. The id is public (it names the key in listings and logs) and finds the
row; only the SHA-256 of the secret is stored, and it is compared with `hmac.compare_digest`, so neither the
database nor the time a check takes gives the secret away. The secret has 256 random bits, so a plain hash
(no slow KDF) is enough: there is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from common.domain.models import ApiKey, new_id, utcnow
from common.infra.db import rowcount

KEY_PREFIX = "vlmq-"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY_RE = re.compile(r"^vlmq-(key_[0-9a-f]{32})\.([A-Za-z0-9_-]{43})$")


class ApiKeyError(ValueError):
    pass


@dataclass(frozen=True)
class CreatedKey:
    id: str
    tenant: str
    key: str  # shown once; only its hash is kept


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def check_tenant_name(tenant: str) -> str:
    if not TENANT_RE.match(tenant):
        raise ApiKeyError(f"tenant name {tenant!r} must be 1-64 characters of letters, digits, '_', '.', '-', "
                          "starting with a letter or digit")
    return tenant


def create_key(session: Session, tenant: str, name: str | None = None) -> CreatedKey:
    check_tenant_name(tenant)
    key_id, secret = new_id("key"), secrets.token_urlsafe(32)
    session.add(ApiKey(id=key_id, tenant=tenant, name=name, secret_sha256=_digest(secret), created_at=utcnow()))
    session.flush()
    return CreatedKey(key_id, tenant, f"{KEY_PREFIX}{key_id}.{secret}")


def tenant_of(session: Session, key: str) -> str | None:
    """The tenant a presented key belongs to, or None (malformed, unknown, revoked or wrong secret)."""
    match = _KEY_RE.match(key)
    if match is None:
        return None
    key_id, secret = match.groups()
    row = session.execute(
        select(ApiKey.tenant, ApiKey.secret_sha256).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return row.tenant if hmac.compare_digest(row.secret_sha256, _digest(secret)) else None


def list_keys(session: Session, tenant: str | None = None) -> list[ApiKey]:
    stmt = select(ApiKey).order_by(ApiKey.id)
    if tenant is not None:
        stmt = stmt.where(ApiKey.tenant == tenant)
    return list(session.scalars(stmt))


def revoke_key(session: Session, key_id: str) -> bool:
    stmt = (update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
            .execution_options(synchronize_session=False))
    return rowcount(session, stmt) == 1
