"""Bearer API keys: every /v1 route runs for one tenant, taken from the key (or `default` when auth is off).

Checked keys are remembered for `auth_cache_seconds`, so a busy client costs one SQL lookup per key per few
seconds, not one per request; a revoked key stops working within that time.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from api.deps import AppState, get_state
from common.domain.apikeys import tenant_of
from common.domain.models import DEFAULT_TENANT

_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


class KeyCache:
    def __init__(self, ttl_seconds: float, max_entries: int = 10_000) -> None:
        self.ttl, self.max_entries = ttl_seconds, max_entries
        self._entries: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def get(self, fingerprint: str) -> str | None:
        with self._lock:
            entry = self._entries.get(fingerprint)
            if entry is None or entry[1] < time.monotonic():
                return None
            return entry[0]

    def put(self, fingerprint: str, tenant: str) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()  # a flood of distinct valid keys only costs lookups again
            self._entries[fingerprint] = (tenant, time.monotonic() + self.ttl)


def _lookup(state: AppState, key: str) -> str | None:
    with state.db.session() as session:
        return tenant_of(session, key)


async def get_tenant(request: Request, state: Annotated[AppState, Depends(get_state)]) -> str:
    if not state.settings.auth_required:
        return DEFAULT_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>' (create one with "
                                 "`vlmq apikey create --tenant NAME`)", headers=_UNAUTHORIZED)
    cache: KeyCache = request.app.state.key_cache
    # Cached under a hash, so the process never keeps presented secrets in memory as they are.
    fingerprint = hashlib.sha256(key.encode()).hexdigest()
    tenant = cache.get(fingerprint)
    if tenant is None:
        tenant = await run_in_threadpool(_lookup, state, key)
        if tenant is None:
            raise HTTPException(401, "invalid API key", headers=_UNAUTHORIZED)
        cache.put(fingerprint, tenant)
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]
